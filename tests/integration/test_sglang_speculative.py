"""SGLang's speculative decoding with the policy's MTP head as its draft, against a real SGLang 0.5.23 server on CPU.

SGLang 0.5.23 cannot decode speculatively on this CPU: its EAGLE-family workers (EAGLE, EAGLE3, NEXTN, STANDALONE)
build draft attention backends only for GPU backends and Intel AMX (speculative/draft_utils.py), and the AMX one
needs the CPU build of sgl_kernel, which the package index does not carry. The test records how far a launch gets:
the converted draft (MiMoMTP) loads, and the server stops at the draft's attention backend. It fails when either
changes, e.g. when a torch_native draft backend arrives and the speculative path can be tested end to end here.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from miles_core.config import SGLangConfig
from miles_core.rollout.engines.sglang import SGLangEngine
from miles_core.rollout.engines.sglang_draft import DRAFT_ARCHITECTURE
from miles_core.rollout.engines.sglang_server import SGLangError
from tests.integration.test_sglang import build_policy, sglang_env_python

pytestmark = pytest.mark.integration


def test_speculative_launch_loads_the_draft_and_stops_at_the_cpu_attention_backend(tmp_path, monkeypatch):
    sglang_env_python()
    policy = build_policy(tmp_path / "policy", seed=0)
    drafts = tmp_path / "tmp"
    drafts.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(drafts))  # where the engine writes its draft model
    with pytest.raises(SGLangError, match="exited with code") as err:
        SGLangEngine(SGLangConfig(startup_timeout_s=600), policy, version=0, speculative_tokens=2)
    log = Path(re.search(r"\(log (\S+)\)", str(err.value)).group(1)).read_text(errors="replace")
    assert f"type={DRAFT_ARCHITECTURE}" in log, "the converted draft model was not loaded"
    assert "ValueError: EAGLE is not supported in decode attention backend torch_native" in log
    assert not list(drafts.glob("sglang-draft-*")), "the failed launch left its draft directory behind"
