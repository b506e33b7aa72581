"""Runs real megatron-core work in its own process (plain `python` = a world of one, or under
torchrun) and prints one JSON line; tests/*/test_megatron*.py and test_checkpoint*.py read it.

    python tests/megatron_worker.py convert ROOT ARCH           HF -> torch_dist -> HF, logits vs HF
    torchrun --nproc_per_node N tests/megatron_worker.py step ROOT CKPT TP EP OUT
                                                               one GRPO step from CKPT, saved to OUT
    torchrun ... tests/megatron_worker.py resume ROOT CKPT OUT [DTYPE]  two steps straight vs a save and load between them
    python tests/megatron_worker.py loss ROOT CKPT             the loss of CKPT's weights on the batch
    torchrun ... tests/megatron_worker.py replay ROOT HF CKPT TP EP  the engine's routing replayed (R3)
    python tests/megatron_worker.py uncompat ROOT CKPT          the same path without the CPU layer
    python tests/megatron_worker.py vs_torch ROOT HF CKPT       RL steps of megatron and of the torch trainer side by side
    python tests/megatron_worker.py bf16 ROOT OUT               RL steps in bf16 (tests/bf16_runs.py)
    torchrun --nproc_per_node 2 tests/megatron_worker.py lora ROOT  LoRA at TP 1 and 2: steps, export, PEFT, resume (tests/megatron_lora.py)
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import torch

from miles_core.config import AlgoConfig, ModelConfig, RolloutConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.samples import Sample
from miles_core.step import bind, optimize
from miles_core.train.base import pack

TINY = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "num_experts": 4,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
}
ALGO = AlgoConfig()
FNS = bind(algo=ALGO, rollout=RolloutConfig(n_samples=4, temperature=1.0))  # groups of 4 (samples())


def samples(n: int = 8) -> list[Sample]:
    """A fixed scored batch: 2 groups of 4, random tokens, rewards 0/1."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        P, R = 5 + i % 3, 4 + i % 2
        tokens = torch.randint(3, 300, (P + R,), generator=g).tolist()
        out.append(
            Sample(
                prompt_id=i // 4,
                index=i % 4,
                prompt_tokens=tokens[:P],
                response_tokens=tokens[P:],
                rollout_logprobs=[-1.0] * R,
                loss_mask=[1] * R,
                finish_reason="stop",
                weight_version=0,
                label="1",
                metadata={},
                reward=float(i % 2),
            )
        )
    return out


def train_cfg(tp: int = 1, ep: int = 1, world: int = 1, pp: int = 1, dtype: str = "float32") -> TrainConfig:
    parallel = dict(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, nproc_per_node=world)
    return TrainConfig(backend="megatron", dtype=dtype, lr=1e-2, micro_batch_size=4, **parallel)


def batch_loss(trainer) -> float:
    """Negative mean log-likelihood of the fixed batch's response tokens under the trainer's weights."""
    batch = pack(samples(), 0)
    logprobs = trainer.logprobs(batch, 1.0)  # [B, T]
    return -float((logprobs * batch.loss_mask).sum() / batch.loss_mask.sum())


def convert(root: Path, *archs: str) -> dict:
    """Every architecture in one process (megatron's import and set-up paid once)."""
    return {arch: convert_one(root / arch, arch) for arch in archs}


# tensors a fresh model leaves at zero or near it, and the scale of the values they get here: sigmoid routers'
# correction biases (which experts win), gpt-oss's attention sinks and expert biases (interleaved gate/up ones)
FRESH_VALUES = {"e_score_correction_bias": 0.1, "sinks": 1.0, "gate_up_proj_bias": 0.1, "down_proj_bias": 0.1}
# config settings lowered so that they act at the tiny model's scale: gpt-oss's SwiGLU clamp (7 in the checkpoint)
ACTING_SETTINGS = {"gpt_oss": {"swiglu_limit": 0.1}}
SEQUENCE = 20  # tokens of the compared input: longer than the tiny gpt-oss's sliding window (8)


def _with_values_that_matter(hf_dir: Path, arch: str) -> None:
    """Give the tensors of FRESH_VALUES values that change the outputs, and the settings of ACTING_SETTINGS theirs."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    state, g = load_file(str(path)), torch.Generator().manual_seed(2)
    fresh = {name: scale for name in state for suffix, scale in FRESH_VALUES.items() if name.endswith(suffix)}
    for name, scale in fresh.items():
        state[name] = torch.randn(state[name].shape, generator=g) * scale
    if fresh:
        save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **ACTING_SETTINGS.get(arch, {})}, indent=2))


def _logit_gap(model, spec, ids: torch.Tensor, expected: torch.Tensor) -> float:
    from miles_core.train.megatron.logits import positions

    with torch.no_grad():
        got = model.eval()(input_ids=ids, position_ids=positions(ids), attention_mask=None)[..., : spec.vocab_size]
    return float((expected - got).abs().max())


def _ablation_gaps(model, spec, ids: torch.Tensor, expected: torch.Tensor) -> dict:
    """The logit gap to HF with the attention sinks left out, and with every window opened to the whole sequence:
    what the comparison would show if the conversion dropped either."""
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    gaps = {}
    if spec.attention_sinks:
        offsets = [core.softmax_offset for core in cores]
        for core in cores:
            core.softmax_offset = None
        gaps["without_sinks"] = _logit_gap(model, spec, ids, expected)
        for core, offset in zip(cores, offsets):
            core.softmax_offset = offset
    if spec.sliding_window:
        windows = [core.scale_mask_softmax.window_size for core in cores]
        for core in cores:
            core.scale_mask_softmax.window_size = None
        gaps["without_windows"] = _logit_gap(model, spec, ids, expected)
        for core, window in zip(cores, windows):
            core.scale_mask_softmax.window_size = window
    return gaps


# families the megatron backend maps that have no tiny family in the project: their transformers classes at TINY's
# sizes, with the MLA head split of the tiny deepseek_v3
_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
BUILT_HERE = {
    # GLM-4.7-Flash: DeepSeek-V3's layers, dense layers named by mlp_layer_types, rms_norm_eps 1e-5
    "glm4_moe_lite": ("Glm4MoeLite", {**_MLA, "q_lora_rank": 48, "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.8}),
    # DeepSeek-V2(-Lite): queries without a low-rank projection, softmax routing limited to the best expert of 2 of 4 groups
    "deepseek_v2": (
        "DeepseekV2",
        {
            **_MLA,
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 1.5,
        },
    ),
}


def _tiny_built_here(arch: str, out: Path) -> None:
    import transformers

    from miles_core.models.tiny import build_tokenizer

    name, fields = BUILT_HERE[arch]
    tokenizer = build_tokenizer()
    sizes = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=0,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        **sizes,
        **fields,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        getattr(transformers, f"{name}ForCausalLM")(config).float().save_pretrained(out)
    tokenizer.save_pretrained(out)


def convert_one(root: Path, arch: str) -> dict:
    from safetensors.torch import load_file

    from miles_core.checkpoint.hf_megatron import text_weights
    from miles_core.checkpoint.torch_dist import hf_to_torch_dist, load_megatron_model, torch_dist_to_hf
    from miles_core.models.loading import load_causal_lm

    if arch in BUILT_HERE:
        _tiny_built_here(arch, root / "hf")
    else:
        build_tiny_model(ModelConfig(arch=arch, **TINY), root / "hf")
    _with_values_that_matter(root / "hf", arch)
    hf_to_torch_dist(root / "hf", root / "mg")
    torch_dist_to_hf(root / "mg", root / "back")
    model, spec = load_megatron_model(root / "mg")
    before, after = text_weights(spec, load_file(str(root / "hf/model.safetensors"))), load_file(str(root / "back/model.safetensors"))
    reference = load_causal_lm(str(root / "hf"), torch.float32).eval()
    exported = load_causal_lm(str(root / "back"), torch.float32).eval()
    ids = torch.randint(0, spec.vocab_size, (2, SEQUENCE), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        again = exported(input_ids=ids).logits
    return {
        "same_names": sorted(before) == sorted(after),
        "bitwise": all(torch.equal(before[k], after[k]) for k in before),
        "max_logit_diff": _logit_gap(model, spec, ids, expected),
        "exported_logits_equal": torch.equal(expected, again),
        "logit_scale": float(expected.abs().max()),
        "sliding_window": spec.sliding_window,
        "sequence": SEQUENCE,
        "processes_left": [p.name for p in multiprocessing.active_children()],  # by the saves
        **_ablation_gaps(model, spec, ids, expected),
    }


def step(ckpt: str, tp: int, ep: int, out: str, pp: int = 1) -> dict:
    import torch.distributed as dist

    from miles_core.train.megatron import cpu_compat
    from miles_core.train.megatron.trainer import MegatronTrainer

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    trainer = MegatronTrainer.load(ckpt, train_cfg(tp, ep, world, pp))
    before = batch_loss(trainer)
    metrics = optimize(trainer, samples(), FNS, 0)
    trainer.save(out)
    after = batch_loss(trainer)
    hits = [None] * dist.get_world_size()
    dist.all_gather_object(hits, sorted(cpu_compat.HITS))
    return {
        "loss_before": before,
        "loss_after": after,
        "train_loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
        "hits": sorted(set().union(*hits)),
        "rank": dist.get_rank(),
    }


def resume(ckpt: str, out: str, dtype: str = "float32") -> dict:
    """Two steps in one go, against one step, a save with optimizer state, a load and one more step."""
    import torch.distributed as dist

    from miles_core.train.megatron.trainer import MegatronTrainer

    cfg = train_cfg(world=int(__import__("os").environ.get("WORLD_SIZE", "1")), dtype=dtype)
    straight = MegatronTrainer.load(ckpt, cfg)
    for _ in range(2):
        optimize(straight, samples(), FNS, 0)
    first = MegatronTrainer.load(ckpt, cfg)
    optimize(first, samples(), FNS, 0)
    first.save(out)
    resumed = MegatronTrainer.load(out, cfg)
    optimize(resumed, samples(), FNS, 0)
    return {"straight": batch_loss(straight), "resumed": batch_loss(resumed), "steps": [straight.step, resumed.step], "rank": dist.get_rank()}


def loss(*ckpts: str) -> dict:
    """The batch loss of each checkpoint loaded at TP=PP=EP=1 (whatever it was saved at)."""
    from miles_core.train.megatron.trainer import MegatronTrainer

    return {"losses": [batch_loss(MegatronTrainer.load(ckpt, train_cfg())) for ckpt in ckpts]}


def replay(hf: str, ckpt: str, tp: int = 1, ep: int = 1) -> dict:
    """R3 through megatron: the embedded engine records its routing on the HF weights, megatron (at TP x EP, sequence
    parallel at TP > 1) replays it after the routers' selection bias moved (what aux-loss-free balancing moves)."""
    import dataclasses
    import os

    import torch.distributed as dist

    from miles_core.rollout.base import SamplingParams
    from miles_core.rollout.engines.torch_engine import TorchEngine
    from miles_core.train.megatron.trainer import MegatronTrainer

    prompts = [[5 + i, 40 + 3 * i, 77, 9 + i, 120 + i][: 3 + i % 3] for i in range(4)]
    generated = TorchEngine(hf, record_routing=True).generate(prompts, SamplingParams(n=2, max_new_tokens=6, seed=3))
    rollout = [
        Sample(str(i), j, p, g.tokens, g.logprobs, [1] * len(g.tokens), g.finish_reason, 0, "1", routed_experts=g.routed_experts)
        for i, (p, group) in enumerate(zip(prompts, generated))
        for j, g in enumerate(group)
    ]
    trainer = MegatronTrainer.load(ckpt, train_cfg(tp, ep, int(os.environ.get("WORLD_SIZE", "1"))))
    with torch.no_grad():
        for name, bias in trainer.ddp.module.named_buffers():
            if name.endswith("expert_bias"):
                bias.copy_(bias.flip(0))  # the experts' biases swapped: the selection moves, the gate values do not
    batch = pack(rollout, 0)

    def gap(packed) -> float:
        return float(((trainer.logprobs(packed, 1.0) - packed.rollout_logprobs).abs() * packed.loss_mask).max())

    replayed = gap(batch)
    agreement = trainer.routing_metrics()["routing/agreement"]
    return {"replayed_gap": replayed, "bare_gap": gap(dataclasses.replace(batch, routed_experts=None)), "agreement": agreement, "rank": dist.get_rank()}


def bf16(out: str) -> dict:
    """tests/bf16_runs.py's RL steps on the megatron backend in bf16, from the tiny policy built in OUT."""
    from miles_core.train.megatron.trainer import MegatronTrainer
    from tests import bf16_runs

    policy = build_tiny_model(bf16_runs.MODEL, f"{out}/policy")
    trainer = MegatronTrainer.from_hf(policy, train_cfg(dtype="bfloat16"))
    optimizers = [part.optimizer for part in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]  # torch's Adam of each
    result = bf16_runs.report(trainer, optimizers, policy, Path(out) / "published")
    return {**result, "matrices": bf16_runs.dtypes(p for p in trainer.ddp.module.parameters() if p.dim() == 2)}  # norms: torch's RMSNorm, fp32


def vs_torch(hf: str, ckpt: str, steps: int = 3) -> dict:
    """`steps` RL updates on the fixed batch by the megatron trainer (from CKPT) and by the torch trainer (from HF, the
    same weights): the largest gap between their weights after each, and both sides' losses and gradient norms."""
    import dataclasses

    from miles_core.train.megatron.trainer import MegatronTrainer
    from miles_core.train.torch_backend import TorchTrainer

    megatron = MegatronTrainer.load(ckpt, train_cfg())
    plain = TorchTrainer.from_hf(hf, dataclasses.replace(train_cfg(), backend="torch"))
    out: dict = {"weight_gap": [], "megatron": [], "torch": []}
    for _ in range(steps):
        for name, trainer in (("megatron", megatron), ("torch", plain)):
            metrics = optimize(trainer, samples(), FNS, 0)
            out[name].append([metrics["train/loss"], metrics["train/grad_norm"]])
        theirs, ours = megatron.hf_state_dict(), plain.hf_state_dict()
        assert theirs.keys() == ours.keys()
        out["weight_gap"].append(max((theirs[k].float() - ours[k].float()).abs().max().item() for k in ours))
    return out


def uncompat(ckpt: str) -> dict:
    """The same load as every other command, with the CPU layer switched off."""
    from miles_core.train.megatron import cpu_compat
    from miles_core.train.megatron.trainer import MegatronTrainer

    cpu_compat.activate = lambda: False
    try:
        MegatronTrainer.load(ckpt, train_cfg())
    except (AssertionError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": ""}


if __name__ == "__main__":
    command, root, *args = sys.argv[1:]
    torch.set_num_threads(1)
    from tests.megatron_lora import lora

    handlers = {
        "convert": convert,
        "step": step,
        "resume": resume,
        "loss": loss,
        "replay": replay,
        "uncompat": uncompat,
        "bf16": bf16,
        "lora": lora,
        "vs_torch": vs_torch,
    }
    args = [int(a) if a.isdigit() else a for a in args]
    result = handlers[command](Path(root), *args) if command in ("convert", "lora") else handlers[command](*args)
    if result.get("rank", 0) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    # the ranks leave their groups together: a rank that exits with its gloo group alive while another rank still uses
    # theirs can abort at exit ("terminate called without an active exception", SIGABRT)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
