"""LoRA on the megatron backend (miles_core/train/megatron/lora.py) with real megatron-core on gloo: a tiny Qwen2 trains
its adapters only, at TP 1 (data parallel 2) and at TP 2 with sequence parallel; the adapter exported under PEFT's names
gives PEFT's model megatron's log-probs; the adapters-only checkpoint resumes exactly and is read back without building
the model.  One worker run of 2 processes (tests/megatron_lora.py) from one converted policy.
"""

import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.megatron_runs import run_worker

pytestmark = pytest.mark.integration
PEFT_GAP = 1e-5  # fp32 log-probs of the same weights in transformers + PEFT and megatron: summation order only


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory(prefix="megatron-lora-") as tmp:  # not pytest's rotated temp folders
        root = Path(tmp)
        runs = run_worker("lora", root, nproc=2)
        yield runs | {"adapters": {name: load_file(str(path)) for name, path in _adapter_files(root)}}


def _adapter_files(root: Path):
    return [(f"tp{tp}{kind}", root / f"adapter-tp{tp}{kind}.safetensors") for tp in (1, 2) for kind in ("", "-checkpoint")]


@pytest.mark.parametrize("run", ["tp1", "tp2"])
def test_only_the_adapters_train(runs, run):
    """Two GRPO steps: the loss moves, every base weight is bitwise what it was, the optimizer steps the adapters alone,
    and the checkpoint holds the adapters (and optimizer state), not the frozen base."""
    result = runs[run]
    assert result["loss_after"] < result["loss_before"] - 1e-3
    assert result["base_unchanged"]
    assert result["optimizer_holds_adapters_only"]
    assert result["held_tensors"] and all(name.endswith((".lora_A", ".lora_B")) for name in result["held_tensors"])


def test_the_exported_adapter_applied_by_peft_gives_megatrons_logprobs(runs):
    adapter = runs["adapters"]["tp1"]
    assert {name.split(".")[-3] for name in adapter} == {f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")}
    assert adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert adapter["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (128, 4)
    assert all(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)  # trained: B left zero
    assert runs["tp1"]["peft_gap"] < PEFT_GAP
    assert runs["tp1"]["merged_gap"] < 1e-6  # the trainer's merged weights (hf_state_dict, export_hf) are PEFT's merge


def test_tensor_parallel_2_trains_the_same_adapter(runs):
    tp1, tp2 = runs["tp1"], runs["tp2"]
    for key in ("loss_before", "loss_after"):
        assert tp2[key] == pytest.approx(tp1[key], abs=1e-5), key
    assert tp2["train_losses"] == pytest.approx(tp1["train_losses"], abs=1e-5)
    one, two = runs["adapters"]["tp1"], runs["adapters"]["tp2"]
    assert one.keys() == two.keys() and all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_checkpoint_holds_the_trainers_adapter(runs, tp):
    """TorchDistCheckpoint.adapter_state_dict (what publishing reads) gives the trainer's adapter bitwise, from a
    checkpoint saved at TP 1 or split over 2 ranks (fc1's [gate; up] halves each split)."""
    trained, read = runs["adapters"][f"tp{tp}"], runs["adapters"][f"tp{tp}-checkpoint"]
    assert trained.keys() == read.keys() and all(torch.equal(trained[k], read[k]) for k in trained)


def test_a_resumed_run_continues_exactly(runs):
    """One step, a save of the adapters with optimizer state (half on each data-parallel rank) and RNG, a load onto the
    HF base and one more step equals two steps in a row, bitwise."""
    tp1 = runs["tp1"]
    assert tp1["resumed"] == tp1["loss_after"]
    assert tp1["resumed_adapter_equal"]


def test_what_the_megatron_adapters_cannot_do_is_refused_naming_the_key(runs):
    no_base, other_rank, moe = runs["tp1"]["refusals"]
    assert no_base.endswith("holds LoRA adapters only (train.lora.rank 4): load it with the base model's HF directory")
    assert other_rank.startswith("train.lora.rank: ") and "holds adapters of rank 4, the recipe asks for 8" in other_rank
    assert moe.startswith("train.lora.rank: the megatron backend adapts dense GQA layers only")
