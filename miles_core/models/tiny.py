"""Tiny HF-format policy and tokenizer, built locally and deterministically (no hub access).

The tokenizer is a byte-level BPE trained with `tokenizers` on a fixed built-in corpus, so any
text (ASCII or not) encodes without unknown tokens, and digits are always single tokens: an
addition answer is then a sequence of per-digit choices, which is what the RL signal acts on.
Special tokens and the chat template are the model family's (miles_core/models/chat_formats.py;
ChatML, as in Qwen2, for the main recipes' qwen2/qwen3/llama/qwen3_moe), each family's special
tokens taking the first ids, so the same code paths work for real checkpoints of that family.

The model is the family's standard transformers class (miles_core/models/families.py; the full
multimodal class for a vision-language family) initialised from `cfg.seed` and saved with
`save_pretrained`, so every consumer (torch engine, SGLang, megatron conversion) loads it like any
other HF checkpoint.  Building twice with the same config gives byte-identical files.
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
from miles_core.models.chat_formats import CHATML, ChatFormat
from miles_core.models.families import FAMILIES, MAX_POSITIONS, hf_config
from miles_core.storage import atomic_dir

PAD_TOKEN, IM_START, IM_END = CHATML.special_tokens  # ids 0, 1, 2 of the ChatML tokenizer
SPECIAL_TOKENS = list(CHATML.special_tokens)
VOCAB_SIZE = 320  # 3 special + 256 bytes + merges learnt from the corpus (fewer if it runs out)
CHAT_TEMPLATE = CHATML.template
__all__ = ["CHAT_TEMPLATE", "IM_END", "IM_START", "MAX_POSITIONS", "PAD_TOKEN", "SPECIAL_TOKENS", "VOCAB_SIZE", "build_tiny_model", "build_tokenizer"]

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


def build_tokenizer(chat: ChatFormat = CHATML) -> transformers.PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on the built-in corpus with `chat`'s special tokens (ids 0..),
    eos, pad and template, and wrap it for transformers.  Every family learns the same merges."""
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
        vocab_size=VOCAB_SIZE + len(chat.special_tokens) - len(CHATML.special_tokens),
        min_frequency=2,
        special_tokens=list(chat.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    roles = {"eos_token": chat.eos, "pad_token": chat.pad} | ({"bos_token": chat.bos} if chat.bos else {})
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **roles,
        additional_special_tokens=[t for t in chat.special_tokens if t not in roles.values()],
        chat_template=chat.template,
        padding_side="left",  # generation batches are left-padded so prompts end together
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def token_ids(chat: ChatFormat, tokenizer) -> dict:
    """Token roles (pad, eos, bos, tool_call_end) and every special token -> id, and the vocabulary size."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in chat.special_tokens}
    roles = {"pad": chat.pad, "eos": chat.eos, "bos": chat.bos, "tool_call_end": chat.tool_call_end}
    return ids | {role: ids[token] for role, token in roles.items() if token} | {"vocab": len(tokenizer)}


def _init_model(cfg: ModelConfig, tokenizer) -> transformers.PreTrainedModel:
    family = FAMILIES[cfg.arch]
    config = hf_config(cfg, token_ids(family.chat, tokenizer))
    model_cls = getattr(transformers, family.model_class)
    # Fork the RNG so seeding here does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_cls(config).float()  # floating tensors only: Llama 4 keeps complex RoPE buffers
    text = config.get_text_config(decoder=True)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
    return model


def build_tiny_model(cfg: ModelConfig, out_dir: str) -> str:
    """Build tokenizer + model from `cfg` and save them as an HF directory at `out_dir`
    (atomically: an existing `out_dir` is replaced only once the new one is complete)."""
    tokenizer = build_tokenizer(FAMILIES[cfg.arch].chat)
    model = _init_model(cfg, tokenizer)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(out_dir)
