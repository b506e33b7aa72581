"""The tiny model and tokenizer: determinism, HF loading, chat template, prompt/answer tokens."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_core.chat import prompt_tokens, response_tokens
from miles_core.config import ModelConfig
from miles_core.models.tiny import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    build_tiny_model,
    build_tokenizer,
)

SAMPLES = ["123+456=", "47+85=", "What is (12-7)*3? Answer: 15.", "  two  spaces\n\ttab", "héllo 日本 ½", ""]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(ModelConfig(arch=arch), str(root / arch)) for arch in ("qwen2", "qwen3")}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tokenizer_special_tokens_and_padding(tokenizer):
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD_TOKEN
    assert IM_START in tokenizer.all_special_tokens
    assert tokenizer.padding_side == "left"
    print(f"vocab size: {len(tokenizer)}")


def test_any_ascii_text_encodes_without_unknowns(tokenizer):
    ascii_text = "".join(chr(c) for c in range(128))
    ids = tokenizer.encode(ascii_text, add_special_tokens=False)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == ascii_text


def test_digits_are_single_tokens_and_roundtrip(tokenizer):
    ids = tokenizer.encode("123+456=", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "2", "3", "+", "4", "5", "6", "="]
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template(tokenizer):
    ids = prompt_tokens(tokenizer, "123+456=")
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == "<|im_start|>user\n123+456=<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("question,answer", [("47+85=", "132"), ("1+2=", "3"), ("what is it?", "The answer is 7.")])
def test_prompt_plus_demonstration_is_the_templated_conversation(tokenizer, question, answer):
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    full = tokenizer.apply_chat_template(chat, tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert full[-len(newline) :] == newline  # the template ends the turn with a newline
    demo = response_tokens(tokenizer, answer)
    assert demo[-1] == tokenizer.convert_tokens_to_ids(IM_END)
    assert prompt_tokens(tokenizer, question) + demo == full[: -len(newline)]


def test_rebuild_is_byte_identical(built, tmp_path):
    again = build_tiny_model(ModelConfig(arch="qwen2"), str(tmp_path / "again"))
    for name in ("model.safetensors", "tokenizer.json"):
        with open(os.path.join(built["qwen2"], name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), name


def test_seed_changes_weights_and_rebuild_replaces_dir(tmp_path):
    out = str(tmp_path / "m")
    build_tiny_model(ModelConfig(num_layers=1, seed=0), out)
    first = Path(out, "model.safetensors").read_bytes()
    assert build_tiny_model(ModelConfig(num_layers=1, seed=1), out) == out
    assert Path(out, "model.safetensors").read_bytes() != first
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no leftover .tmp / .old directories


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_hf_directory_loads_and_runs(built, tokenizer, arch):
    path = built[arch]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(path, name)), name
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    loaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    im_end, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    assert model.config.eos_token_id == im_end and model.config.pad_token_id == pad
    assert model.generation_config.eos_token_id == im_end and model.generation_config.pad_token_id == pad
    assert model.config.vocab_size == len(tokenizer) and model.config.tie_word_embeddings
    assert loaded.eos_token == IM_END and loaded.pad_token == PAD_TOKEN and loaded.padding_side == "left"
    for text in SAMPLES:  # the loaded tokenizer encodes exactly like the built one
        assert loaded.encode(text) == tokenizer.encode(text)
    assert prompt_tokens(loaded, "1+2=") == prompt_tokens(tokenizer, "1+2=")
    ids = torch.tensor([prompt_tokens(loaded, "47+85=")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    print(f"{arch} default parameters: {sum(p.numel() for p in model.parameters()):,}")


def test_tokenizer_is_identical_in_a_fresh_interpreter(tokenizer):
    # Rust hash maps are seeded per process, so an in-process rebuild alone would not catch
    # order-dependent training.
    code = "from miles_core.models.tiny import build_tokenizer; print(build_tokenizer().backend_tokenizer.to_str())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == tokenizer.backend_tokenizer.to_str()
