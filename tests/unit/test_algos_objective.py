"""The algorithm library, part two: loss weights (aggregation modes), KL with old log-probs and
IS corrections. Hand-derived numbers in the comments and
properties with hypothesis, on the helpers of test_algos_library.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from miles_core.algos.corrections import importance_weights, mismatch_metrics
from miles_core.algos.kl import kl_penalty
from miles_core.algos.losses import loss_weights
from miles_core.algos.objective import is_weights
from miles_core.config import AlgoConfig
from tests.unit.test_algos_library import LN2, PROPERTY, batches, close, randn

# --------------------------------------------------------------------------- loss weights


def test_loss_weights_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])  # B = 2, L = [3, 1], 4 tokens
    # token-mean: 1 / 4 per token
    close(loss_weights(mask, "token-mean"), [[0.25, 0.25, 0.25, 0], [0.25, 0, 0, 0]])
    # seq-mean-token-mean: 1 / (2 * 3) = 0.1667 on row 0, 1 / (2 * 1) = 0.5 on row 1
    close(loss_weights(mask, "seq-mean-token-mean"), [[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0]])
    # seq-mean-token-sum: 1 / 2 per token
    close(loss_weights(mask, "seq-mean-token-sum"), [[0.5, 0.5, 0.5, 0], [0.5, 0, 0, 0]])
    # seq-mean-token-sum-norm, horizon 4: 1 / (2 * 4) = 0.125 per token, whatever the lengths
    close(loss_weights(mask, "seq-mean-token-sum-norm", horizon=4), [[0.125, 0.125, 0.125, 0], [0.125, 0, 0, 0]])
    # the default is token-mean
    close(loss_weights(mask), loss_weights(mask, "token-mean"))


def test_loss_weights_with_empty_rows_by_hand():
    # rows: L = [2, 0, 1, 0] (rows 1 and 3 filtered out); 3 tokens, S = 2 non-empty sequences, B = 4 rows
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [0, 0]])
    # token-mean: 1 / 3 per token
    close(loss_weights(mask, "token-mean"), [[1 / 3, 1 / 3], [0, 0], [1 / 3, 0], [0, 0]])
    # seq-mean-token-mean: mean over the S = 2 sequences that have tokens: 1 / (2 * 2) = 0.25 on row 0,
    #   1 / (2 * 1) = 0.5 on row 2; the weights still sum to 1 (dividing by B = 4 would give 0.5)
    close(loss_weights(mask, "seq-mean-token-mean"), [[0.25, 0.25], [0, 0], [0.5, 0], [0, 0]])
    # seq-mean-token-sum: 1 / S = 0.5 per token (sum of token sums over the 2 sequences)
    close(loss_weights(mask, "seq-mean-token-sum"), [[0.5, 0.5], [0, 0], [0.5, 0], [0, 0]])
    # seq-mean-token-sum-norm, horizon 2: a constant 1 / (B * horizon) = 1 / 8 per token, empty rows counted
    close(loss_weights(mask, "seq-mean-token-sum-norm", horizon=2), [[0.125, 0.125], [0, 0], [0.125, 0], [0, 0]])
    # an all-empty mini-batch: zeros in every mode, no NaN
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        close(loss_weights(torch.zeros(2, 3), mode, 4), torch.zeros(2, 3))


def test_loss_weights_aggregate_a_loss_as_their_docstring_says():
    # per-token loss [[1, 3], [9, 9], [5, 7]], mask [[1, 1], [0, 0], [1, 0]]: sequence 0 tokens 1, 3; sequence 2 token 5
    loss, mask = torch.tensor([[1.0, 3.0], [9.0, 9.0], [5.0, 7.0]]), torch.tensor([[1, 1], [0, 0], [1, 0]])
    total = {
        mode: float((loss_weights(mask, mode, horizon=4) * loss).sum())
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    }
    assert total["token-mean"] == pytest.approx((1 + 3 + 5) / 3)  # 3
    assert total["seq-mean-token-mean"] == pytest.approx((2 + 5) / 2)  # token-means 2 and 5 over 2 sequences
    assert total["seq-mean-token-sum"] == pytest.approx((4 + 5) / 2)  # token sums 4 and 5 over 2 sequences
    assert total["seq-mean-token-sum-norm"] == pytest.approx((4 + 5) / (3 * 4))  # over B = 3 rows x horizon 4


def test_loss_weights_unknown_mode_names_it():
    with pytest.raises(ValueError, match=r"'seq-sum'.*token-mean, seq-mean-token-mean"):
        loss_weights(torch.ones(1, 1), "seq-sum")


@PROPERTY
@given(batch=batches(max_rows=5, max_len=7), horizon=st.integers(1, 16))
def test_loss_weights_sum_to_one_and_dr_grpo_is_a_constant_normaliser(batch, horizon):
    mask, _ = batch
    assert abs(loss_weights(mask, "token-mean").sum().item() - 1.0) < 1e-5
    assert abs(loss_weights(mask, "seq-mean-token-mean").sum().item() - 1.0) < 1e-5
    # seq-mean-token-sum sums to the mean length
    assert abs(loss_weights(mask, "seq-mean-token-sum").sum().item() - mask.sum(1).mean().item()) < 1e-5
    # Dr.GRPO: every token weighs 1 / (B * horizon), independent of its sequence's length
    close(loss_weights(mask, "seq-mean-token-sum-norm", horizon), (mask / (mask.shape[0] * horizon)).float(), atol=1e-7)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        weights = loss_weights(mask, mode, horizon)
        assert (weights[mask == 0] == 0).all() and (weights[mask == 1] > 0).all()


# --------------------------------------------------------------------------- KL with old log-probs


def test_unbiased_kl_by_hand():
    # token 0: pi 0.5, ref 0.25, old 0.25 -> ratio pi / old = 2;   k3 = 0.5 + ln 2 - 1 = 0.1931 -> 0.3863
    # token 1: pi 0.25, ref 0.5, old 0.5  -> ratio 0.5;            k3 = 2 - ln 2 - 1  = 0.3069 -> 0.1534
    # k1: ln 2 * 2 = 1.3863, -ln 2 * 0.5 = -0.3466
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    old = ref.clone()
    close(kl_penalty(logprobs, ref, "k3", old_logprobs=old), [[0.3863, 0.1534]])
    close(kl_penalty(logprobs, ref, "k1", old_logprobs=old), [[1.3863, -0.3466]])
    # old == pi: ratio 1, the plain estimate
    close(kl_penalty(logprobs, ref, "k3", old_logprobs=logprobs), kl_penalty(logprobs, ref, "k3"), atol=0)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 6), kind=st.sampled_from(["k1", "k3"]))
def test_unbiased_kl_is_exact_kl_in_value_and_gradient_under_the_old_policy(seed, vocab, kind):
    # exact expectation over the vocabulary (no sampling): E_{x ~ pi_old}[kl_penalty(x)]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    log_old = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    log_ref = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    log_pi = torch.log_softmax(logits, -1)
    # k3 is clamped to [-10, 10] (verl's bound); the identity holds where the clamp is inactive
    assume(bool((kl_penalty(log_pi.view(1, -1), log_ref.view(1, -1), kind).abs() < 10.0).all()))
    estimate = (log_old.exp() * kl_penalty(log_pi.view(1, -1), log_ref.view(1, -1), kind, log_old.view(1, -1))).sum()
    (grad_estimate,) = torch.autograd.grad(estimate, logits)
    # the target: KL(pi || ref) = sum_x pi (log pi - log ref), differentiated directly
    log_pi = torch.log_softmax(logits, -1)
    true_kl = (log_pi.exp() * (log_pi - log_ref)).sum()
    (grad_true,) = torch.autograd.grad(true_kl, logits)
    close(estimate.detach(), true_kl.detach(), atol=1e-9)
    close(grad_estimate, grad_true, atol=1e-9)


# --------------------------------------------------------------------------- IS corrections


def test_mismatch_metrics_by_hand():
    # log w = train - rollout = [ln 2, 0] (the third token is padding, its 5.0 is ignored), w = [2, 1]
    #   |delta logp|: (0.6931 + 0) / 2 = 0.3466
    #   KL(rollout || train), k3 with r = w: (2 - 1 - ln 2 + 0) / 2 = 0.3069 / 2 = 0.1534
    #   ESS ratio: (2 + 1)^2 / (2 * (4 + 1)) = 9 / 10 = 0.9
    #   beyond the default threshold 0.1: ln 2 = 0.69 is, 0 is not -> 1 / 2
    train = torch.tensor([[LN2, 0.0, 5.0]])
    metrics = mismatch_metrics(train, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert metrics.keys() == {"mismatch/abs_logprob_diff", "mismatch/kl_rollout_train", "mismatch/ess_ratio", "mismatch/beyond_threshold_fraction"}
    assert metrics["mismatch/beyond_threshold_fraction"] == 0.5
    assert abs(metrics["mismatch/abs_logprob_diff"] - 0.3466) < 1e-4
    assert abs(metrics["mismatch/kl_rollout_train"] - 0.1534) < 1e-4
    assert abs(metrics["mismatch/ess_ratio"] - 0.9) < 1e-6
    # identical policies: no mismatch, ESS 1
    same = mismatch_metrics(train, train, torch.ones(1, 3))
    assert same == {"mismatch/abs_logprob_diff": 0.0, "mismatch/kl_rollout_train": 0.0, "mismatch/ess_ratio": 1.0, "mismatch/beyond_threshold_fraction": 0.0}


def test_beyond_threshold_fraction_by_hand():
    # |train - rollout| = [[0.125, 0.5, 0.25], [0.375, 1.0, pad]] (exact in binary): 5 tokens, padding (9.0) ignored
    #   threshold 0.25: 0.5, 0.375 and 1.0 are above (0.25 itself is not) -> 3 / 5 = 0.6
    #   threshold 0.5: only 1.0 -> 1 / 5 = 0.2; threshold 1.0: none -> 0
    train = torch.tensor([[-1.125, -0.5, -2.25], [-0.625, -3.0, 9.0]])
    rollout = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    fractions = [mismatch_metrics(train, rollout, mask, threshold=t)["mismatch/beyond_threshold_fraction"] for t in (0.25, 0.5, 1.0)]
    assert fractions == pytest.approx([0.6, 0.2, 0.0])
    # the IS-correction plug-point reports it at algo.mismatch_threshold
    _, metrics = is_weights(AlgoConfig(is_correction="tis", mismatch_threshold=0.5), train, rollout, mask)
    assert metrics["mismatch/beyond_threshold_fraction"] == pytest.approx(0.2)


# token weights w = [[2, 0.25, 1], [3, 0.5, pad]], bounds [0.5, 2]; the padded train log-prob 7.0 is ignored
IS_TRAIN = torch.tensor([[LN2, math.log(0.25), 0.0], [math.log(3.0), math.log(0.5), 7.0]])
IS_ROLLOUT = torch.zeros(2, 3)
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_importance_weights_token_level_by_hand():
    # tis: min(w, 2) -> [[2, 0.25, 1], [2, 0.5, 0]]; clipped 1 of 5 tokens (the 3) = 0.2;
    #   mean weight (2 + 0.25 + 1 + 2 + 0.5) / 5 = 1.15
    w, metrics = importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "tis", "token", 0.5, 2.0)
    close(w, [[2.0, 0.25, 1.0], [2.0, 0.5, 0.0]])
    assert abs(metrics["mismatch/tis_clipped_fraction"] - 0.2) < 1e-6
    assert abs(metrics["mismatch/is_weight_mean"] - 1.15) < 1e-5
    # mis: 0.25 < 0.5 and 3 > 2 are zeroed, the bounds themselves (2, 0.5) are kept:
    #   [[2, 0, 1], [0, 0.5, 0]]; masked 2 / 5 = 0.4; mean (2 + 1 + 0.5) / 5 = 0.7
    w, metrics = importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "mis", "token", 0.5, 2.0)
    close(w, [[2.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    assert abs(metrics["mismatch/mis_masked_fraction"] - 0.4) < 1e-6
    assert abs(metrics["mismatch/is_weight_mean"] - 0.7) < 1e-5
    assert "mismatch/ess_ratio" in metrics


def test_importance_weights_sequence_level_by_hand():
    # sequence weights: row 0 exp(ln 2 + ln 0.25 + 0) = 0.5, row 1 exp(ln 3 + ln 0.5) = 1.5 (padding excluded)
    # tis, upper 2: nothing above -> [[0.5] * 3, [1.5, 1.5, 0]], clipped 0
    w, metrics = importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "tis", "sequence", 0.5, 2.0)
    close(w, [[0.5, 0.5, 0.5], [1.5, 1.5, 0.0]])
    assert metrics["mismatch/tis_clipped_fraction"] == 0.0
    # tis, upper 1.2: row 1 truncated to 1.2, 2 of 5 tokens clipped
    w, metrics = importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "tis", "sequence", 0.5, 1.2)
    close(w, [[0.5, 0.5, 0.5], [1.2, 1.2, 0.0]])
    assert abs(metrics["mismatch/tis_clipped_fraction"] - 0.4) < 1e-6
    # mis, lower 0.6: row 0 (0.5) is masked out whole -> [[0, 0, 0], [1.5, 1.5, 0]], 3 of 5 = 0.6
    w, metrics = importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "mis", "sequence", 0.6, 2.0)
    close(w, [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0]])
    assert abs(metrics["mismatch/mis_masked_fraction"] - 0.6) < 1e-6


def test_importance_weights_unknown_mode_or_level_names_it():
    with pytest.raises(ValueError, match=r"'xis'.*tis, mis"):
        importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "xis", "token", 0.5, 2.0)
    with pytest.raises(ValueError, match=r"'group'.*token, sequence"):
        importance_weights(IS_TRAIN, IS_ROLLOUT, IS_MASK, "tis", "group", 0.5, 2.0)


@PROPERTY
@given(
    batch=batches(max_len=6),
    mode=st.sampled_from(["tis", "mis"]),
    level=st.sampled_from(["token", "sequence"]),
    lower=st.floats(0.0, 0.99),
    upper=st.floats(1.01, 5.0),
)
def test_importance_weights_respect_their_truncation(batch, mode, level, lower, upper):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    rollout = randn(mask.shape, gen) - 1.0
    train = (rollout + randn(mask.shape, gen, 0.7)).requires_grad_()
    w, metrics = importance_weights(train, rollout, mask, mode, level, lower, upper)
    assert not w.requires_grad
    assert (w[mask == 0] == 0).all() and (w >= 0).all()
    kept = w[mask == 1]
    if mode == "tis":
        assert (kept <= upper).all()
    else:
        assert ((kept == 0) | ((kept >= lower) & (kept <= upper))).all()
    if level == "sequence":  # one weight per sequence
        for row, length in zip(w, mask.sum(1).long()):
            assert (row[:length] == row[0]).all()
    assert 0.0 <= metrics[f"mismatch/{mode}_{'clipped' if mode == 'tis' else 'masked'}_fraction"] <= 1.0
