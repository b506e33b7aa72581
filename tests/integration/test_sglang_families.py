"""Every model family at tiny size served by the real SGLang 0.5.23 server on CPU (its own environment, `make sglang-env`).

For each family of the families tier (tests/families/conftest.py) the tiny checkpoint is built, a server
is launched on it (one per family: each holds its own model), a few chat prompts are rolled out greedily
through SGLangEngine, and the log-probs SGLang reports for its tokens are compared with the torch
trainer's on the same tokens (fp32 on both sides).  A mixture-of-experts family's server returns the experts
of every token (--enable-return-routed-experts, R3); the trainer replays them, and its own routers agree.

A family SGLang cannot serve at tiny size on CPU is in REFUSED (miles_core/rollout/engines/sglang_families.py, which
admission reads) with the error it stops with; its test
launches the server and asserts that exactly that refusal still happens, so the test fails (and the
table must shrink) once SGLang or the stand-ins serve it.

Launching costs 30 s to 2 min per family here, so only REPRESENTATIVE runs in the default suite; the
rest are in the `sglang_families` tier (`make test-sglang-families`).
"""

from __future__ import annotations

import math
import re

import pytest
from transformers import AutoTokenizer

from miles_core.config import SGLangConfig
from miles_core.config.model import DENSE_ARCHS
from miles_core.models.tiny import build_tiny_model
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engines.sglang import SGLangEngine
from miles_core.rollout.engines.sglang_families import CPU_REFUSALS
from miles_core.rollout.engines.sglang_server import SGLangError
from tests.families.conftest import FAMILIES, tiny_config
from tests.integration.test_sglang import LOGPROB_TOLERANCE, sglang_env_python, trainer_logprob_gap

pytestmark = pytest.mark.integration

REPRESENTATIVE = "qwen3_moe"  # in the default suite: MoE routing, QK norm, GQA
MESSAGES = ["1+1=", "What is 47+85? Think step by step.", "Compute (12-7)*3."]
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_token_ids=())
HYBRID = "--mamba-radix-cache-strategy no_buffer --disable-overlap-schedule"  # linear-attention state snapshots need a GPU platform

# launch_server arguments a family needs on CPU beyond the engine's own
SERVE_ARGS = dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_moe"), HYBRID)

REFUSED = CPU_REFUSALS  # family -> (what SGLang 0.5.23 stops with when serving it at tiny size on CPU, why)


def family_params(families) -> list:
    return [arch if arch == REPRESENTATIVE else pytest.param(arch, marks=pytest.mark.sglang_families) for arch in families]


SERVED = [arch for arch in FAMILIES if arch not in REFUSED]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-families")
    return lambda arch: build_tiny_model(tiny_config(arch), str(root / arch))


def launch(arch: str, policy_dir: str) -> SGLangEngine:
    sglang_env_python()
    cfg = SGLangConfig(startup_timeout_s=600, max_total_tokens=4096, max_batch_sequences=8, max_concurrency=1, extra_args=SERVE_ARGS.get(arch, ""))
    return SGLangEngine(cfg, policy_dir, version=0, record_routing=arch not in DENSE_ARCHS)


@pytest.mark.parametrize("arch", family_params(SERVED))
def test_family_is_served_and_its_logprobs_equal_the_trainers(arch, family_dir, record_property):
    policy = family_dir(arch)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True) for m in MESSAGES]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in rendered]
    engine = launch(arch, policy)
    try:
        out = engine.generate(prompts, GREEDY)
    finally:
        engine.close()
    for (gen,) in out:
        assert 1 <= len(gen.tokens) == len(gen.logprobs) <= GREEDY.max_new_tokens
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)
    gap, routing = trainer_logprob_gap(policy, prompts, out, 1.0, pad_id=tokenizer.pad_token_id)  # greedy log-probs are softmax(logits)
    record_property("max_logprob_gap", gap)  # in --junitxml reports: the families' table
    assert gap < LOGPROB_TOLERANCE, f"{arch}: max |SGLang - trainer| log-prob gap {gap:.2e}"
    if arch not in DENSE_ARCHS:  # SGLang's experts, replayed: the trainer's routers choose the same on these fp32 weights
        fed = [len(p) + len(g.tokens) - 1 for p, (g,) in zip(prompts, out)]
        assert [len(g.routed_experts) % n for n, (g,) in zip(fed, out)] == [0] * len(out)
        assert routing["routing/agreement"] > 0.99


@pytest.mark.parametrize("arch", family_params(REFUSED))
def test_refused_family_still_fails_for_its_stated_reason(arch, family_dir):
    error, why = REFUSED[arch]
    try:
        engine = launch(arch, family_dir(arch))
    except SGLangError as err:
        assert re.search(error, str(err)), f"{arch} now fails otherwise than because {why}:\n{err}"
    else:
        engine.close()
        pytest.fail(f"SGLang now serves {arch} ({why} no longer holds): move it from REFUSED to the served families")
