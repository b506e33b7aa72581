"""The torch trainer backend: the HF model itself, AdamW, micro-batches and gradient clipping.

The embedded default. `TorchCritic` is the same trainer around a value model (the policy's
transformer with a scalar head, HF's *ForTokenClassification), for PPO; its `logprobs` are
the values V(s_t) of the state before each response token.  A checkpoint is a directory holding the model as HF safetensors
(`save_pretrained`), `optimizer.pt` and `trainer_state.json` (step, torch RNG state), so a
resumed run continues bitwise on CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from miles_core.algos.kl import entropy_from_logits, token_logprobs
from miles_core.config import TrainConfig
from miles_core.algos.losses import loss_weights
from miles_core.train.base import LossFn, PackedBatch, WeightsFn

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchTrainer:
    auto_class = AutoModelForCausalLM
    model_kwargs: dict = {}

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, step: int = 0):
        self.model = model.float().train()
        self.cfg = cfg
        self.step = step
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
        )

    @classmethod
    def from_hf(cls, policy_dir: str, cfg: TrainConfig) -> "TorchTrainer":
        torch.manual_seed(cfg.seed)
        return cls(cls.auto_class.from_pretrained(policy_dir, dtype=torch.float32, **cls.model_kwargs), cfg)

    @classmethod
    def load(cls, ckpt_dir: str, cfg: TrainConfig) -> "TorchTrainer":
        state = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text())
        trainer = cls(cls.auto_class.from_pretrained(ckpt_dir, dtype=torch.float32, **cls.model_kwargs), cfg, step=state["step"])
        optim_file = Path(ckpt_dir) / "optimizer.pt"
        if optim_file.exists():  # a freshly converted checkpoint has no optimizer state yet
            trainer.optimizer.load_state_dict(torch.load(optim_file, weights_only=True))
        torch.set_rng_state(torch.load(Path(ckpt_dir) / "rng.pt", weights_only=True))
        return trainer

    def save(self, ckpt_dir: str) -> None:
        self.model.save_pretrained(ckpt_dir, safe_serialization=True)
        if self.step:
            torch.save(self.optimizer.state_dict(), Path(ckpt_dir) / "optimizer.pt")
        torch.save(torch.get_rng_state(), Path(ckpt_dir) / "rng.pt")
        (Path(ckpt_dir) / "trainer_state.json").write_text(json.dumps({"step": self.step, "backend": "torch"}))

    def export_hf(self, out_dir: str, dtype: str) -> None:
        state = {k: v.detach().to(_DTYPES[dtype]) for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)

    def _forward(self, batch: PackedBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]  # [b, L-1, V]
        index = batch.gather_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        response_logits = logits.gather(1, index)  # [b, T, V]
        targets = batch.input_ids[:, 1:].gather(1, batch.gather_index)  # [b, T]
        logprobs = token_logprobs(response_logits, targets, temperature) * batch.response_mask
        entropy = entropy_from_logits(response_logits / temperature) * batch.response_mask  # in the graph: entropy bonus
        return logprobs, entropy

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        step = self.cfg.micro_batch_size
        return torch.cat([self._forward(batch.select(slice(i, i + step)), temperature)[0] for i in range(0, len(batch), step)])

    def train_on(self, batch: PackedBatch, extras: dict, loss_fn: LossFn, temperature: float, lr: float | None = None, weights_fn: WeightsFn = loss_weights) -> dict[str, float]:
        started = time.perf_counter()
        sums: dict[str, float] = {}
        total_tokens = float(batch.loss_mask.sum())
        mini = -(-len(batch) // self.cfg.mini_batches)
        grad_norms = []
        for m_start in range(0, len(batch), mini):
            m_rows = slice(m_start, m_start + mini)
            weights = weights_fn(batch.loss_mask[m_rows])  # [b_mini, T]
            for group in self.optimizer.param_groups:
                group["lr"] = lr if lr is not None else self.cfg.lr * min(1.0, (self.step + 1) / max(self.cfg.warmup_steps, 1))
            self.optimizer.zero_grad(set_to_none=True)
            for start in range(m_start, min(m_start + mini, len(batch)), self.cfg.micro_batch_size):
                rows = slice(start, min(start + self.cfg.micro_batch_size, m_start + mini))
                micro = batch.select(rows)
                logprobs, entropy = self._forward(micro, temperature)
                loss, metrics = loss_fn(logprobs, entropy, micro.loss_mask, {k: v[rows] for k, v in extras.items()})
                (loss * weights[rows.start - m_start : rows.stop - m_start]).sum().backward()
                if entropy is not None:
                    metrics = {"entropy": entropy.detach(), **metrics}
                for name, values in {"loss": loss.detach(), **metrics}.items():
                    sums[name] = sums.get(name, 0.0) + float((values * micro.loss_mask).sum())
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)))
            self.optimizer.step()
            self.step += 1
        seconds = time.perf_counter() - started
        out = {f"train/{k}": v / max(total_tokens, 1.0) for k, v in sums.items()}
        out.update({
            "train/grad_norm": sum(grad_norms) / len(grad_norms),
            "train/tokens_per_s": float(batch.attention_mask.sum()) / seconds,
            "train/step": float(self.step),
        })
        return out



class TorchCritic(TorchTrainer):
    auto_class = AutoModelForTokenClassification
    model_kwargs = {"num_labels": 1}

    def _forward(self, batch: PackedBatch, temperature: float) -> tuple[torch.Tensor, None]:
        hidden = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, 0]  # [b, L-1]
        return hidden.gather(1, batch.gather_index) * batch.response_mask, None  # [b, T] V before each token
