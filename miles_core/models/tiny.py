"""Tiny HF-format policy and tokenizer, built locally and deterministically (no hub access).

The tokenizer is a byte-level BPE trained with `tokenizers` on a fixed built-in corpus, so any
text (ASCII or not) encodes without unknown tokens, and digits are always single tokens: an
addition answer is then a sequence of per-digit choices, which is what the RL signal acts on.
Special tokens and the chat template follow ChatML (as in Qwen2), so the same code paths work
for real Qwen checkpoints.

The model is a standard `Qwen2ForCausalLM` / `Qwen3ForCausalLM` initialised from `cfg.seed` and
saved with `save_pretrained`, so every consumer (torch engine, SGLang, megatron conversion)
loads it like any other HF checkpoint.  Building twice with the same config gives
byte-identical `model.safetensors` and `tokenizer.json`.
"""

from __future__ import annotations

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# AutoTokenizer rebuilds a "qwen2" checkpoint's tokenizer with Qwen2's own normalizer and split
# pattern, so the tokenizer is built with exactly those: it then encodes the same before and
# after a save/load round trip, whichever class loads it.  The pattern's `\p{N}` alternative
# isolates every digit (the same as `pre_tokenizers.Digits(individual_digits=True)`).
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from miles_core.config import ModelConfig
from miles_core.storage import atomic_dir

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 320  # 3 special + 256 bytes + merges learnt from the corpus (fewer if it runs out)
MAX_POSITIONS = 512

# Qwen2's ChatML template without its implicit default system turn (the prompts carry none).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Fixed training text: role names, a few English words and arithmetic in several spellings.
# The byte alphabet already guarantees coverage; this only decides which merges are learnt.
_CORPUS = [
    "user\nassistant\nsystem\n",
    "What is 47+85? The answer is 132.",
    "Compute (12-7)*3 = 15. What is the sum? The result is 38.",
    "Question: what is 15+23? Answer: 38.",
    "Add the numbers and give the answer. Think step by step.",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789 + - * = ( ) ? . , : ! / % < > [ ] { } ' \" _ # @ & ^ ~ | ; $ \\ `",
    "the answer is the sum of the two numbers. the result is correct.",
    "You are a helpful assistant. Please answer the question.",
    "is the answer right? yes. is it wrong? no. plus minus times equals",
]


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on the built-in corpus and wrap it for transformers."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    # Digits are isolated before merges are learnt, so no merge ever glues two digits together.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # generation batches are left-padded so prompts end together
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def _model_config(cfg: ModelConfig, tokenizer) -> transformers.PretrainedConfig:
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": pad_id,  # as in Qwen: <|endoftext|> doubles as bos, never prepended
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    if cfg.arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if cfg.arch in _MORE_ARCHS:
        return _MORE_ARCHS[cfg.arch][0](cfg, common)
    return transformers.Qwen3Config(head_dim=cfg.hidden_size // cfg.num_heads, **common)


def _llama_config(cfg: ModelConfig, common: dict) -> transformers.PretrainedConfig:
    # untied output layer: the architecture's usual choice, and the other half of the conversion tests
    return transformers.LlamaConfig(head_dim=cfg.hidden_size // cfg.num_heads, **{**common, "tie_word_embeddings": False})


def _qwen3_moe_config(cfg: ModelConfig, common: dict) -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        head_dim=cfg.hidden_size // cfg.num_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        **{**common, "tie_word_embeddings": False},
    )


# arch -> (config builder, model class) for the architectures beyond qwen2/qwen3
_MORE_ARCHS = {
    "llama": (_llama_config, transformers.LlamaForCausalLM),
    "qwen3_moe": (_qwen3_moe_config, transformers.Qwen3MoeForCausalLM),
}


def _init_model(cfg: ModelConfig, tokenizer) -> transformers.PreTrainedModel:
    config = _model_config(cfg, tokenizer)
    model_cls = transformers.Qwen2ForCausalLM if cfg.arch == "qwen2" else transformers.Qwen3ForCausalLM
    model_cls = _MORE_ARCHS[cfg.arch][1] if cfg.arch in _MORE_ARCHS else model_cls
    # Fork the RNG so seeding here does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model


def build_tiny_model(cfg: ModelConfig, out_dir: str) -> str:
    """Build tokenizer + model from `cfg` and save them as an HF directory at `out_dir`
    (atomically: an existing `out_dir` is replaced only once the new one is complete)."""
    tokenizer = build_tokenizer()
    model = _init_model(cfg, tokenizer)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(out_dir)
