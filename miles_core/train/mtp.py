"""Online MTP-SFT: the draft head (models/mtp.py) learns, every training step, to predict the step's own rollout tokens.

The loss is DeepSeek-V3's MTP loss at depth 1, a cross-entropy of token t+2 given the policy's hidden state at t and
token t+1, on the batch's trained tokens (its loss mask), with one departure in the target: the policy's own
distribution of that token (its logits at t+1, computed in the same pass) instead of the one token sampled there.
At temperature 1 both have the same expectation, H(p, q); the full distribution has far less variance, and it is
what acceptance compares the draft with (sum over x of min(p, q)).  A second departure is what it may move: there
the MTP loss (weighted by lambda) also trains the shared trunk; here the policy's hidden states are computed
without gradient and its final norm and lm_head enter with detached weights, so the head's loss never moves the
policy, whose update stays exactly the RL objective's.  The head therefore has its own AdamW (train.mtp_lr; a loss
weight would be cancelled by Adam's normalisation) and its own gradient clipping (train.grad_clip), one step per
training step, on the policy's weights after that step's update: what the next rollout drafts against.
Every data-parallel process trains the head on the whole batch, so the replicas stay identical without a reduction.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles_core.models.mtp import MTP_DIR, HiddenTap, MtpHead, build_head, draft_logits, has_head, load_head, save_head
from miles_core.train.base import PackedBatch
from miles_core.train.optimizer_state import OPTIMIZER, load_optimizer, save_optimizer

MTP_OPTIMIZER = f"{MTP_DIR}/{OPTIMIZER}"  # in a checkpoint, beside the head


def trained_positions(batch: PackedBatch) -> torch.Tensor:
    """[B, L] true at the input positions of the batch's trained tokens (loss mask > 0)."""
    trained = batch.loss_mask > 0  # [B, T]
    index = (batch.gather_index + 1) * trained  # response token j sits at input position gather_index + 1; padding -> 0
    return torch.zeros_like(batch.input_ids, dtype=torch.bool).scatter_(1, index, trained)  # position 0 is never a response token


def mtp_loss(head: MtpHead, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Summed cross-entropy H(p, q) at every position where `targets` [B, L] is true: q the head's prediction from the
    policy's hidden state two positions before, p the policy's own next-token distribution there (right-padded
    input_ids [B, L]); metrics: summed loss, positions where the head's top token is the policy's, count."""
    tap = HiddenTap(model)
    try:
        with torch.no_grad():
            policy_logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, L, V]
            hidden, next_embeds = tap.take(), model.get_input_embeddings()(input_ids[:, 1:])  # [B, L, H], [B, L-1, H]
    finally:
        tap.remove()
    positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # [B, L]
    g = head(hidden[:, :-1].float(), next_embeds.float(), positions[:, :-1], attention_mask[:, :-1])  # [B, L-1, H]: g_t predicts t+2
    selected = targets[:, 2:]  # [B, L-2]
    draft = draft_logits(model, g[:, :-1][selected]).float().log_softmax(dim=-1)  # [N, V]
    policy = policy_logits[:, 1:-1][selected].float()  # [N, V] the policy's distribution of the same token
    loss = -(policy.softmax(dim=-1) * draft).sum()
    agree = float((draft.argmax(dim=-1) == policy.argmax(dim=-1)).sum())
    return loss, {"loss": float(loss.detach()), "agree": agree, "tokens": float(policy.shape[0])}


class MtpTrainer:
    """The draft head beside a trainer's policy, with its own AdamW: `train_on` after each policy update, `save` into
    the checkpoint (head + optimizer state), `export` into a published version (head alone)."""

    def __init__(self, head: MtpHead, cfg):
        self.head, self.cfg = head.float().train(), cfg
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.mtp_lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)

    @classmethod
    def for_policy(cls, model: torch.nn.Module, source_dir: str, cfg) -> MtpTrainer | None:
        """The head of `source_dir` (a policy or checkpoint directory) with its optimizer state, a fresh one when it
        holds none; None when train.mtp_lr is 0 or the model has no LM head to share (a value model: PPO's critic)."""
        if cfg.mtp_lr == 0 or model.get_output_embeddings() is None:
            return None
        head = load_head(source_dir) if has_head(source_dir) else build_head(model.config, cfg.seed)
        trainer = cls(head.to(model.device), cfg)
        load_optimizer(trainer.optimizer, Path(source_dir) / MTP_OPTIMIZER)  # a policy directory's head has none
        return trainer

    def train_on(self, model: torch.nn.Module, batch: PackedBatch) -> dict[str, float]:
        """One optimizer step of the head on the batch's trained tokens, in micro-batches of train.micro_batch_size rows."""
        targets = trained_positions(batch)
        total = float(targets[:, 2:].sum())
        if total == 0:  # responses of one token: nothing two positions ahead
            return {}
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "agree": 0.0}
        for start in range(0, len(batch), self.cfg.micro_batch_size):
            rows = slice(start, start + self.cfg.micro_batch_size)
            loss, metrics = mtp_loss(self.head, model, batch.input_ids[rows], batch.attention_mask[rows], targets[rows])
            (loss / total).backward()
            sums = {k: sums[k] + metrics[k] for k in sums}
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip))
        self.optimizer.step()
        return {"train/mtp_loss": sums["loss"] / total, "train/mtp_top1_agreement": sums["agree"] / total, "train/mtp_grad_norm": grad_norm}

    def save(self, ckpt_dir: str) -> None:
        save_head(self.head, ckpt_dir)
        save_optimizer(self.optimizer, Path(ckpt_dir) / MTP_OPTIMIZER)

    def export(self, policy_dir: str) -> None:
        save_head(self.head, policy_dir)
