"""Train/rollout mismatch per rollout precision, with and without routing replay (R3), on a tiny MoE. Prints one JSON
object.

For each precision the trainer publishes its policy as the rollout engine loads it, the embedded engine samples
responses from it (recording its routing), and the trainer recomputes their log-probs, routed by itself and with the
rollout's experts replayed:
* fp32: engine and trainer in fp32 (the reference: the same numbers but for summation order);
* bf16: the engine in bf16 (`rollout.dtype`), the trainer computing with its bf16 copy of the weights (`train.dtype`);
* fp8, mxfp8: the engine on FP8 / MXFP8 weights (`publish.quantization`), the trainer in fp32;
* int4: the engine on int4 weights (groups of 32), the trainer in fp32; int4-qat: the same with `train.qat: int4`.
Reported per row: mean |train - rollout log-prob|, KL(rollout || train), the fraction of tokens beyond
`algo.mismatch_threshold`, and the share of the rollout's experts the trainer's routers choose themselves.

    python bench/precision.py [--experts 16] [--top-k 4] [--layers 4] [--prompts 32] [--samples 4] [--tokens 24]
"""

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
from measure import emit
from tqdm import tqdm

from miles_core.algos.corrections import mismatch_metrics
from miles_core.config import MISMATCH_THRESHOLD, ModelConfig, TrainConfig
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.torch_engine import TorchEngine
from miles_core.samples import Sample
from miles_core.train.base import pack
from miles_core.train.torch_backend import TorchTrainer
from miles_core.weights.publish import publish

# precision -> (trainer settings, engine dtype, published format)
PRECISIONS = {
    "fp32": ({}, torch.float32, ""),
    "bf16": ({"dtype": "bfloat16"}, torch.bfloat16, ""),
    "fp8": ({}, torch.float32, "fp8"),
    "mxfp8": ({}, torch.float32, "mxfp8"),
    "int4": ({}, torch.float32, "int4-g32"),
    "int4-qat": ({"qat": "int4", "qat_group_size": 32}, torch.float32, "int4-g32"),
}


def rollout(engine: TorchEngine, args) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(args.prompts)]
    groups = engine.generate(prompts, SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.tokens, seed=1))
    return [
        Sample(str(i), j, p, x.tokens, x.logprobs, [1] * len(x.tokens), x.finish_reason, 0, "", routed_experts=x.routed_experts)
        for i, (p, group) in enumerate(zip(prompts, groups))
        for j, x in enumerate(group)
    ]


def measure(base: str, name: str, root: Path, args) -> list[dict]:
    settings, engine_dtype, fmt = PRECISIONS[name]
    trainer = TorchTrainer.from_hf(base, TrainConfig(**settings))
    publish(trainer, base, root / name, "float32", version=0, parent_version=None, quantization=fmt)
    batch = pack(rollout(TorchEngine(str(root / name), dtype=engine_dtype, record_routing=True), args), 0)
    rows = []
    for replay in (False, True):
        logprobs = trainer.logprobs(batch if replay else dataclasses.replace(batch, routed_experts=None), 1.0)
        mismatch = mismatch_metrics(logprobs, batch.rollout_logprobs, batch.loss_mask, threshold=MISMATCH_THRESHOLD)
        rows.append(
            {
                "precision": name,
                "r3": replay,
                "abs_logprob_diff": mismatch["mismatch/abs_logprob_diff"],
                "kl_rollout_train": mismatch["mismatch/kl_rollout_train"],
                "beyond_threshold_fraction": mismatch["mismatch/beyond_threshold_fraction"],
                **({"routing_agreement": trainer.routing_metrics()["routing/agreement"]} if replay else {}),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ModelConfig(
        arch="qwen3_moe",
        hidden_size=128,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        num_experts=args.experts,
        moe_top_k=args.top_k,
        moe_intermediate_size=64,
    )
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp:
        base = build_tiny_model(model, str(Path(tmp) / "base"))
        rows = [row for name in tqdm(PRECISIONS, desc="precisions") for row in measure(base, name, Path(tmp), args)]
    emit({"model": dataclasses.asdict(model), "threshold": MISMATCH_THRESHOLD, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
