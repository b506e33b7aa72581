"""TorchEngine against the RolloutEngine contract, on tiny random Qwen2 models built here."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from miles_core.config import RolloutConfig
from miles_core.models import with_cache
from miles_core.rollout.base import Generation, RolloutEngine, SamplingParams
from miles_core.rollout.engines import make_engine
from miles_core.rollout.engines.torch_engine import OneDnnHead, TorchEngine, sample_next_tokens
from miles_core.rollout.sampling import argmax, draw
from miles_core.weights.check import CheckpointError

VOCAB = 64
STOP_IDS = tuple(range(6))  # ~10% of the vocabulary: some responses stop, some run to length
PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30], [40, 41, 42, 43, 44]]


def build_tiny_qwen2(path, seed: int, tied: bool = False, intermediate_size: int = 384) -> str:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        initializer_range=0.2,  # peaked enough that top-k / greedy choices are not near-ties
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def policy_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    return build_tiny_qwen2(root / "v0", seed=0), build_tiny_qwen2(root / "v1", seed=1)


@pytest.fixture(scope="module")
def engine(policy_dirs):
    return TorchEngine(policy_dirs[0], version=7)


@pytest.fixture(scope="module")
def reference_model(policy_dirs):
    return AutoModelForCausalLM.from_pretrained(policy_dirs[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls gain nothing from a second thread, and with other processes on the 2 cores an
    # OpenMP barrier can wait a whole time slice (~12 ms for a [16, 128] x [128, 384] matmul).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def flatten(out: list[list[Generation]]) -> list[Generation]:
    return [g for gens in out for g in gens]


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.weight_version == 7


def test_shapes_stop_and_length_contract(engine):
    params = SamplingParams(n=4, max_new_tokens=12, stop_token_ids=STOP_IDS, seed=3)
    out = engine.generate(PROMPTS, params)
    assert len(out) == len(PROMPTS) and all(len(gens) == 4 for gens in out)
    reasons = set()
    for g in flatten(out):
        reasons.add(g.finish_reason)
        assert len(g.tokens) == len(g.logprobs) >= 1
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert all(0 <= t < VOCAB for t in g.tokens)
        assert g.weight_version == 7
        assert not set(g.tokens[:-1]) & set(STOP_IDS), "nothing may follow a stop token"
        if g.finish_reason == "stop":
            assert g.tokens[-1] in STOP_IDS
            assert len(g.tokens) <= 12
        else:
            assert g.finish_reason == "length"
            assert len(g.tokens) == 12 and g.tokens[-1] not in STOP_IDS
    assert reasons == {"stop", "length"}


def test_all_stopped_early_ends_batch(engine):
    # every token is a stop token: each response is exactly one token long
    params = SamplingParams(n=2, max_new_tokens=10, stop_token_ids=tuple(range(VOCAB)))
    for g in flatten(engine.generate(PROMPTS, params)):
        assert g.finish_reason == "stop" and len(g.tokens) == 1 == len(g.logprobs)


def test_same_seed_same_output_other_seed_differs(engine):
    params = SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=11)
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    other = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=12))
    assert [g.tokens for g in flatten(other)] != [g.tokens for g in flatten(first)]


def test_the_kv_cache_goes_to_the_model_by_its_current_name(engine):
    """transformers 5 renamed a forward's `past_key_values` to `cache` (the old name warns on every decode step); a
    forward that has no `cache` still gets `past_key_values`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=1))
    assert with_cache(engine.model, "kv") == {"cache": "kv"}
    assert with_cache(torch.nn.Linear(1, 1), "kv") == {"past_key_values": "kv"}  # a forward without `cache`


def test_global_rng_untouched(engine):
    state = torch.get_rng_state()
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=5))
    assert torch.equal(torch.get_rng_state(), state)


def recompute_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """Full forward over prompt + response, unpadded: log_softmax(logits / T) at the response."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [S, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 8, 0.9), (0.0, 0, 1.0)],
)
def test_logprobs_match_recompute_with_left_padding(engine, reference_model, temperature, top_k, top_p):
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=2)
    out = engine.generate(PROMPTS, params)  # prompts of lengths 3, 8, 1, 5: left-padded in one batch
    for prompt, gens in zip(PROMPTS, out):
        for g in gens:
            # reported log-probs are under softmax(logits / T) without top-k/top-p renormalisation
            expected = recompute_logprobs(reference_model, prompt, g.tokens, temperature or 1.0)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=1e-4, rtol=0)
            if top_k:
                ids = torch.tensor([prompt + g.tokens])
                with torch.no_grad():
                    logits = reference_model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                top = logits.topk(top_k, dim=-1).indices
                assert all(t in top[i] for i, t in enumerate(g.tokens)), "sampled outside top-k"


@pytest.mark.parametrize(
    "temperature, top_k, top_p, expected",
    [
        (1.0, 0, 1.0, torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), -1)),
        (0.5, 0, 1.0, torch.softmax(torch.tensor([4.0, 2.0, 1.0, 0.0, -2.0]), -1)),
        # top-k 3 keeps the first three tokens; their probabilities are renormalised for sampling
        (1.0, 3, 1.0, torch.softmax(torch.tensor([2.0, 1.0, 0.5, -1e9, -1e9]), -1)),
        # top-p 0.6: token 0 alone holds 0.56 < 0.6, with token 1 it reaches 0.77 -> two tokens
        (1.0, 0, 0.6, torch.softmax(torch.tensor([2.0, 1.0, -1e9, -1e9, -1e9]), -1)),
    ],
)
def test_sampler_frequencies_and_unfiltered_logprobs(temperature, top_k, top_p, expected):
    rows = 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(rows, 1)  # [B, V]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = sample_next_tokens(logits, params, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=5).float() / rows
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)  # ~4 sigma at 40k draws
    unfiltered = torch.log_softmax(logits[0] / temperature, dim=-1)
    torch.testing.assert_close(logprobs, unfiltered[tokens])


@pytest.mark.parametrize("vocab", [5, 64, 200, 8193])
def test_draw_picks_the_token_of_one_running_sum_over_the_vocabulary(vocab):
    """Block by block, the draw lands where one float64 running sum over the vocabulary does for the same uniform
    (zero weights and a last block shorter than the others included), never on a token of zero weight."""
    rows, g = 500, torch.Generator().manual_seed(vocab)
    weights = torch.rand((rows, vocab), generator=g) ** 4 * (torch.rand((rows, vocab), generator=g) < 0.3)  # [B, V]
    weights[:, -1] += 1e-3  # every row has some weight
    tokens = draw(weights, torch.Generator().manual_seed(0))
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    uniform = torch.rand((rows, 1), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(tokens, torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1))
    assert bool((weights.gather(-1, tokens[:, None]) > 0).all())


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 200, 8193])
def test_blocked_argmax_is_torchs_on_ties_nan_and_infinities(vocab):
    """The greedy step's argmax (two levels of blocks) answers torch.argmax's first maximal index on rows full of ties,
    with NaNs (maximal for argmax), infinities and rows of -inf alone, whatever the vocabulary's last block holds."""
    g = torch.Generator().manual_seed(vocab)
    for trial in range(60):
        logits = torch.randint(-3, 4, (7, vocab), generator=g).float()  # [B, V], many ties
        for every, value, share in ((5, float("nan"), 0.05), (7, float("-inf"), 0.5), (13, float("inf"), 0.1), (11, float("-inf"), 1.0)):
            if trial % every == 0:
                logits[torch.rand(logits.shape, generator=g) < share] = value
        assert torch.equal(argmax(logits), logits.argmax(-1))


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> ids [B, L] left-padded with 0, attention mask [B, L] (0 on the padding)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    return input_ids, torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])


def test_greedy_equals_hf_generate(engine, reference_model):
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=(3, 9))
    out = engine.generate(PROMPTS, params)
    input_ids, attention_mask = left_padded(PROMPTS)
    width = input_ids.shape[1]
    with torch.no_grad():
        hf = reference_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=[3, 9],
            pad_token_id=0,
        )[:, width:].tolist()
    for gens, hf_row in zip(out, hf):
        tokens = gens[0].tokens
        assert hf_row[: len(tokens)] == tokens
        assert all(t == 0 for t in hf_row[len(tokens) :])  # HF pads after its stop
    # greedy does not depend on the seed or on how the batch is chunked
    # (log-probs only up to float noise: padding changes the batch's arithmetic)
    chunked = TorchEngine(engine.policy_dir, version=7, max_batch_sequences=1)
    alone = chunked.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(3, 9), seed=99))
    assert [g.tokens for g in flatten(alone)] == [gens[0].tokens for gens in out]


def test_each_prompt_prefilled_once_decodes_as_every_row_prefilled(engine, reference_model):
    """The n copies of a prompt share one prefill: greedy tokens and log-probs are those of HF generate prefilling
    every row of the left-padded batch (prompts of four lengths)."""
    n, new = 3, 10
    out = engine.generate(PROMPTS, SamplingParams(n=n, temperature=0.0, max_new_tokens=new))
    input_ids, attention_mask = left_padded([p for p in PROMPTS for _ in range(n)])
    with torch.no_grad():
        hf = reference_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = hf.sequences[:, input_ids.shape[1] :]  # [B, S]
    logprobs = torch.stack(hf.logits, dim=1).log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, S]
    for row, g in enumerate(flatten(out)):
        assert g.tokens == tokens[row].tolist()
        torch.testing.assert_close(torch.tensor(g.logprobs), logprobs[row], atol=1e-5, rtol=0)


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts [V] against expected counts [V], bins expecting under 5 pooled into one
    -> (statistic, degrees of freedom)."""
    small = expected < 5
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def test_sampled_tokens_follow_the_models_distribution(engine, reference_model):
    """4000 samples of one prompt, fixed seed: the first token's counts and the second's (given each sample's first)
    pass a chi-square test against the model's softmax at 5 sigma, and the first's fail it at temperature 0.8."""
    prompt, n = PROMPTS[1], 4000
    pairs = torch.tensor([g.tokens for g in engine.generate([prompt], SamplingParams(n=n, max_new_tokens=2, seed=0))[0]])  # [n, 2]
    with torch.no_grad():
        first_logits = reference_model(input_ids=torch.tensor([prompt])).logits[0, -1]  # [V]
        second = reference_model(input_ids=torch.tensor([prompt + [t] for t in range(VOCAB)])).logits[:, -1].softmax(-1)  # [V, V]
    first_counts, second_counts = (torch.bincount(pairs[:, i], minlength=VOCAB).double() for i in (0, 1))
    for counts, probs in [(first_counts, first_logits.softmax(-1)), (second_counts, second[pairs[:, 0]].mean(0))]:
        statistic, dof = chi_square(counts, n * probs.double())
        assert statistic < dof + 5 * (2 * dof) ** 0.5
    statistic, dof = chi_square(first_counts, n * (first_logits / 0.8).softmax(-1).double())
    assert statistic > dof + 5 * (2 * dof) ** 0.5


def test_chunking_keeps_order_and_counts(policy_dirs):
    small = TorchEngine(policy_dirs[0], version=1, max_batch_sequences=3)
    out = small.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, stop_token_ids=STOP_IDS))
    assert [len(gens) for gens in out] == [2, 2, 2, 2]
    assert all(len(g.tokens) == len(g.logprobs) for g in flatten(out))


def test_load_weights_changes_outputs_and_version(policy_dirs):
    engine = TorchEngine(policy_dirs[0], version=0)
    params = SamplingParams(n=2, max_new_tokens=8, seed=4)
    before = engine.generate(PROMPTS, params)
    engine.load_weights(policy_dirs[1], version=1)
    assert engine.weight_version == 1
    after = engine.generate(PROMPTS, params)
    assert all(g.weight_version == 1 for g in flatten(after))
    assert [g.logprobs for g in flatten(after)] != [g.logprobs for g in flatten(before)]
    assert [g.tokens for g in flatten(after)] != [g.tokens for g in flatten(before)]


def decoded(engine: TorchEngine) -> list[tuple[list[int], list[float]]]:
    return [(g.tokens, g.logprobs) for g in flatten(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=3)))]


@pytest.mark.parametrize("tied", [False, True])
def test_a_policy_of_the_same_architecture_loads_into_the_model_built_as_into_a_new_one(tmp_path, tied):
    """Weights whose config files are the loaded ones' are copied into the model built already (a shared engine's next
    policy): it decodes exactly as an engine built on them; a tied head comes with the embedding."""
    first, second = (build_tiny_qwen2(tmp_path / f"v{seed}", seed, tied) for seed in (0, 1))
    engine = TorchEngine(first)
    model, before = engine.model, decoded(engine)  # decoding packs the output head for the first weights
    engine.load_weights(second, version=1)
    assert engine.model is model and engine.weight_version == 1
    assert decoded(engine) == decoded(TorchEngine(second, version=1)) != before


def test_a_policy_of_another_shape_or_with_other_tensors_is_loaded_anew(policy_dirs, tmp_path):
    """Another architecture is built anew; a directory whose config matches but whose tensors do not (one missing, one
    an integer) is judged by the full load, which names what is wrong and keeps the policy loaded."""
    engine = TorchEngine(policy_dirs[0], version=0)
    model, wider = engine.model, build_tiny_qwen2(tmp_path / "wider", 2, intermediate_size=256)
    engine.load_weights(wider, version=1)
    assert engine.model is not model and decoded(engine) == decoded(TorchEngine(wider, version=1))
    engine.load_weights(policy_dirs[0], version=2)
    tensors = load_file(f"{policy_dirs[1]}/model.safetensors")
    for change, error in [
        (lambda t: t.pop("lm_head.weight"), "tensor lm_head.weight missing"),
        (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].long()}), "tensor lm_head.weight has dtype I64"),
    ]:
        broken = tmp_path / f"broken-{len(error)}"
        shutil.copytree(policy_dirs[1], broken)
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(broken / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=error):
            engine.load_weights(str(broken), version=3)
        assert engine.weight_version == 2 and decoded(engine) == decoded(TorchEngine(policy_dirs[0], version=2)), error


def test_a_shared_engine_is_the_process_one_for_its_settings(policy_dirs):
    """make_engine(shared=True) hands every caller with the same settings one engine, loaded with the caller's policy;
    other settings, or shared=False, get an engine of their own."""
    first = make_engine(RolloutConfig(), policy_dirs[0], 0, shared=True, max_batch_sequences=7)
    second = make_engine(RolloutConfig(), policy_dirs[1], 1, shared=True, max_batch_sequences=7)
    assert second is first and (first.policy_dir, first.weight_version) == (policy_dirs[1], 1)
    assert make_engine(RolloutConfig(), policy_dirs[1], 1, shared=True, max_batch_sequences=8) is not first
    assert make_engine(RolloutConfig(), policy_dirs[1], 1, max_batch_sequences=7) is not first


def test_state_dict_handed_over_reaches_the_output_head(policy_dirs):
    """Weights loaded in memory (the async phase's hand-over) are the ones decoded with, the output head's prepacked
    copy included: greedy tokens and log-probs equal those of an engine that loaded the same weights from files."""
    engine, fresh = TorchEngine(policy_dirs[0]), TorchEngine(policy_dirs[1], version=1)
    assert isinstance(engine.model.get_output_embeddings().forward, OneDnnHead) == torch.backends.mkldnn.is_available()
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    engine.generate(PROMPTS, params)  # the head packed for version 0's weights
    engine.load_state_dict(fresh.model.state_dict(), version=1)
    handed, loaded = flatten(engine.generate(PROMPTS, params)), flatten(fresh.generate(PROMPTS, params))
    assert [g.tokens for g in handed] == [g.tokens for g in loaded]
    assert [g.logprobs for g in handed] == [g.logprobs for g in loaded]


def test_output_head_logits_equal_the_linear_layers(policy_dirs):
    """The oneDNN head computes the nn.Linear's logits, up to the order of a row's sums (bitwise on this repository's
    CPU at this hidden size; another instruction set's kernels may add in another order: the class's docstring)."""
    head = TorchEngine(policy_dirs[0]).model.get_output_embeddings()
    hidden = torch.randn(5, 3, head.in_features, generator=torch.Generator().manual_seed(0))[:, -1:]  # a strided slice, as logits_to_keep feeds
    with torch.inference_mode():
        torch.testing.assert_close(head(hidden), torch.nn.functional.linear(hidden, head.weight, head.bias), rtol=0, atol=1e-5)
    head(hidden).sum().backward()  # a pass with gradients (the engine's model trained by someone) reaches the weight
    assert head.weight.grad is not None and bool(head.weight.grad.abs().sum() > 0)


def test_bad_inputs_are_named(engine, tmp_path):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[0\] has token id 64"):
        engine.generate([[1, 64]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(CheckpointError, match="config.json: missing"):
        engine.load_weights(str(tmp_path), version=3)
    assert engine.weight_version == 7  # a failed load keeps the current policy


def test_num_threads_applies_only_while_generating(policy_dirs):
    engine = TorchEngine(policy_dirs[0], num_threads=1)
    torch.set_num_threads(2)
    try:
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
