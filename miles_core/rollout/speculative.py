"""Speculative decoding in the embedded engine: the MTP head drafts, the policy verifies, the output is the policy's.

Each round the head (miles_core/models/mtp.py) drafts k tokens, chaining its own output (after the policy's final
norm) as the next hidden state (as SGLang's NEXTN/EAGLE drafters do); the policy then reads the last emitted token and the k drafts in one forward
pass.  Draft d_i, drawn from the head's distribution q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i));
at the first rejection the token is drawn from normalize(max(0, p_i - q_i)), and when all k pass a bonus token is
drawn from p_{k+1}.  p and q are the distributions the ordinary sampler draws from (softmax(logits / T), then
top-k and top-p; one-hot argmax for greedy), so every emitted token follows the policy's sampling distribution
exactly, and greedy output is the ordinary greedy output.  Log-probs are the policy's, from the verifying pass,
under the `Generation` contract (softmax(logits / T), before truncation).

Departs from per-row speculation in one place: the rows of a batch advance together, by the fewest drafts any
unfinished row accepted plus one, so the policy's DynamicCache is cropped once for the whole batch.  A row that
accepted more emits, at that slot, its accepted draft, which is a draw of that token's distribution like a
residual draw (the rule is per token), so the output stays exact; the cost is speed at large batches, where the
slowest row sets the pace.  The acceptance counted per row is its own (leading accepted drafts / drafted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from miles_core.models import with_cache
from miles_core.models.mtp import HeadCache, HiddenTap, MtpHead, draft_hidden, head_logits
from miles_core.rollout.base import Generation, SamplingParams
from miles_core.rollout.sampling import draw, sample_next_tokens, truncate


def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] raw logits -> the ordinary sampler's distribution [..., V]: one-hot argmax when greedy, else
    softmax(logits / T) restricted by top-k then top-p and renormalised."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    scaled = (logits / params.temperature).reshape(-1, logits.shape[-1])  # HF's warpers take [N, V]
    return truncate(scaled, params).softmax(dim=-1).view(logits.shape)


def policy_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] -> log softmax(logits / T) [..., V] (temperature 1 for greedy): what `Generation.logprobs` holds."""
    return (logits.float() / (1.0 if params.greedy else params.temperature)).log_softmax(dim=-1)


def acceptance_metrics(groups: list[list[Generation]]) -> dict[str, float]:
    """{"rollout/spec_accept_rate": accepted drafts / drafted tokens} of a rollout's generations; {} when none drafted."""
    drafted = sum(g.drafted_tokens for group in groups for g in group)
    return {"rollout/spec_accept_rate": sum(g.accepted_tokens for group in groups for g in group) / drafted} if drafted else {}


def _pick(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, S, V] at index [B, S] -> [B, S]."""
    return values.gather(-1, index[..., None]).squeeze(-1)


@dataclass
class _State:
    cache: DynamicCache  # the policy's, over every fed position
    head_cache: HeadCache  # the head's, over positions whose policy hidden state it has read
    attention_mask: torch.Tensor  # [B, fed] 0 on left padding
    last_position: torch.Tensor  # [B, 1] position id of the last fed token
    pending_hidden: torch.Tensor  # [B, P, H] policy hidden states the head has not read yet
    pending_next: torch.Tensor  # [B, P] the token after each of them
    pending_positions: torch.Tensor  # [B, P]
    token: torch.Tensor  # [B] the last emitted token, not fed to the policy yet


class Speculator:
    """Decodes a left-padded batch with `head` drafting up to `draft_tokens` tokens per policy forward pass."""

    def __init__(self, model, head: MtpHead, draft_tokens: int, pad_token_id: int):
        self.model, self.head, self.draft_tokens, self.pad_token_id = model, head, draft_tokens, pad_token_id
        self.embed = model.get_input_embeddings()

    def decode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded [B, L] prompts -> (new tokens [B, S], log-probs [B, S], drafted [B], accepted [B]), S <= max_new_tokens.

        As the ordinary loop: rows that hit a stop token emit pad ids until every row has stopped."""
        (batch, budget), device = (input_ids.shape[0], params.max_new_tokens), input_ids.device
        tokens = torch.full((batch, budget), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, budget), device=device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        drafted, accepted = torch.zeros(batch, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device)
        tap = HiddenTap(self.model)
        try:
            state, logprobs[:, 0] = self._prefill(tap, input_ids, attention_mask, params, generator)
            tokens[:, 0], finished, emitted = state.token, torch.isin(state.token, stop_ids), 1
            while emitted < budget and not bool(finished.all()):
                k = min(self.draft_tokens, budget - emitted - 1)  # the round emits at most k + 1 tokens
                drafts, q = self._draft(state, k, params, generator)
                new_tokens, new_logprobs, row_accepted = self._verify(tap, state, drafts, q, finished, params, generator)
                drafted += k * ~finished
                accepted += row_accepted * ~finished
                is_stop = torch.isin(new_tokens, stop_ids).long()  # [B, m + 1]
                stopped_before = finished[:, None] | (is_stop.cumsum(dim=1) - is_stop > 0)
                width = new_tokens.shape[1]
                tokens[:, emitted : emitted + width] = new_tokens.masked_fill(stopped_before, self.pad_token_id)
                logprobs[:, emitted : emitted + width] = new_logprobs
                finished |= is_stop.bool().any(dim=1)
                emitted += width
        finally:
            tap.remove()
        return tokens[:, :emitted], logprobs[:, :emitted], drafted, accepted

    def _prefill(self, tap, input_ids, attention_mask, params, generator) -> tuple[_State, torch.Tensor]:
        """The prompts through the policy; the first token drawn by the ordinary sampler."""
        cache = DynamicCache(config=self.model.config)
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)  # as HF generate
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **with_cache(self.model, cache), use_cache=True, logits_to_keep=1
        )
        token, logprob = sample_next_tokens(out.logits[:, -1], params, generator)
        pending_next = torch.cat([input_ids[:, 1:], token[:, None]], dim=1)
        return _State(cache, HeadCache(), attention_mask, position_ids[:, -1:], tap.take(), pending_next, position_ids, token), logprob

    def _draft(self, state: _State, k: int, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafts [B, k] and the distributions they were drawn from [B, k, V]; the head first reads the pending
        policy hidden states, then chains its own output. The chained positions stay in its cache until `_verify`."""
        if k == 0:  # the budget's last token: no head pass (the loop ends after this round)
            rows, device = state.token.shape[0], state.token.device
            return torch.zeros((rows, 0), dtype=torch.long, device=device), torch.zeros((rows, 0, 1), device=device)
        g = self.head(state.pending_hidden, self.embed(state.pending_next), state.pending_positions, state.attention_mask, state.head_cache)[:, -1:]
        drafts, qs, position, key_mask = [], [], state.last_position, state.attention_mask
        for _ in range(k):
            hidden = draft_hidden(self.model, g[:, -1:])  # [B, 1, H]
            q = warped_probs(head_logits(self.model, hidden[:, -1]), params)  # [B, V]
            drafts.append(draw(q, generator))
            qs.append(q)
            if len(drafts) < k:
                position, key_mask = position + 1, torch.cat([key_mask, torch.ones_like(key_mask[:, :1])], dim=1)
                g = self.head(hidden, self.embed(drafts[-1][:, None]), position, key_mask, state.head_cache)
        return torch.stack(drafts, dim=1), torch.stack(qs, dim=1)

    def _verify(self, tap, state: _State, drafts, q, finished, params, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last token and the drafts through the policy; returns the round's tokens [B, m + 1], their policy
        log-probs [B, m + 1] and each row's leading accepted drafts [B]; the caches keep the emitted positions only."""
        batch, k = drafts.shape
        fed_before = state.attention_mask.shape[1]  # the head has read them all (`_draft`); its chained positions follow
        feed = torch.cat([state.token[:, None], drafts], dim=1)  # [B, k + 1]
        positions = state.last_position + torch.arange(1, k + 2, device=feed.device)  # [B, k + 1]
        mask = torch.cat([state.attention_mask, torch.ones_like(feed)], dim=1)
        out = self.model(
            input_ids=feed, attention_mask=mask, position_ids=positions, **with_cache(self.model, state.cache), use_cache=True, logits_to_keep=k + 1
        )
        p, logp = warped_probs(out.logits, params), policy_logprobs(out.logits, params)  # [B, k + 1, V]
        uniform = torch.rand((batch, k), generator=generator).to(feed.device)  # the CPU stream, as `draw`'s
        passed = uniform * _pick(q, drafts) < _pick(p[:, :k], drafts)  # accept w.p. min(1, p/q)
        row_accepted = passed.long().cumprod(dim=1).sum(dim=1)  # [B]
        m = int(row_accepted.masked_fill(finished, k).min())
        if m < k:
            residual = (p[:, m] - q[:, m]).clamp_(min=0.0)
            residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[:, m])  # p == q: never rejected
            last = torch.where(row_accepted > m, drafts[:, m], draw(residual, generator))
        else:
            last = draw(p[:, k], generator)
        new_tokens = torch.cat([drafts[:, :m], last[:, None]], dim=1)  # [B, m + 1]
        state.cache.crop(-(k - m))  # drops the rejected drafts' positions (transformers 5: a negative count)
        state.head_cache.crop(fed_before)
        state.attention_mask, state.last_position, state.token = mask[:, : fed_before + m + 1], positions[:, m : m + 1], last
        state.pending_hidden, state.pending_next, state.pending_positions = tap.take()[:, : m + 1], new_tokens, positions[:, : m + 1]
        return new_tokens, _pick(logp[:, : m + 1], new_tokens), row_accepted
