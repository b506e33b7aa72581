"""rollout: the engine, sampling, dynamic sampling, SGLang servers and multi-turn tools."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_core.config.base import check as _check
from miles_core.config.base import check_finite

WEIGHT_SYNC_MODES = ("disk", "distributed")
PAUSE_MODES = ("abort", "retract", "in_place")
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang rollout servers (rollout.engine: sglang); see miles_core/rollout/engines/sglang.py."""

    urls: str = ""  # comma-separated http://host:port of running servers to attach to; empty = launch
    num_servers: int = 1  # servers launched on 127.0.0.1 when urls is empty
    tensor_parallel: int = 1  # GPUs per launched server (SGLang's --tp-size); on cuda the rollout pod requests num_servers x this
    python: str = ""  # the SGLang environment's python; empty = $MILES_SGLANG_ENV or the `make sglang-env` cache path
    device: str = "cpu"  # cpu (SGLANG_USE_CPU_ENGINE=1 + the CPU stand-ins) | cuda
    max_total_tokens: int = 65536  # KV cache size in tokens (the CPU default would reserve 13 GB)
    dtype: str = "float32"
    extra_args: str = ""  # further launch_server arguments, space-separated
    startup_timeout_s: float = 300.0  # launch until /health answers
    request_timeout_s: float = 300.0  # any single HTTP call
    max_concurrency: int = 4  # /generate calls in flight per server
    max_batch_sequences: int = 64  # sequences per /generate call
    max_restarts: int = 2  # restarts of a dead launched server per engine before giving up
    weight_sync: str = "disk"  # disk: update_weights_from_disk | distributed: broadcast over a process group
    sync_backend: str = "gloo"  # process-group backend of distributed sync (nccl on GPUs)
    bucket_mb: float = 64.0  # distributed sync: flattened bucket size per broadcast
    pause_mode: str = "abort"  # how in-flight requests are paused for an update (aborted ones are resubmitted)
    sleep_on_idle: bool = True  # an idle scheduler otherwise polls at ~0.7 of a core (measured here), taking it from the trainer

    def __post_init__(self):
        check_finite(self, "rollout.sglang")
        _check(self.num_servers >= 1, "rollout.sglang.num_servers", "must be >= 1")
        _check(self.tensor_parallel >= 1, "rollout.sglang.tensor_parallel", "must be >= 1")
        _check(
            self.tensor_parallel == 1 or self.device == "cuda",
            "rollout.sglang.tensor_parallel",
            f"{self.tensor_parallel} GPUs per server need device: cuda (a CPU server here is one process)",
        )
        _check(self.device in ("cpu", "cuda"), "rollout.sglang.device", f"must be cpu or cuda, got {self.device!r}")
        _check(self.max_total_tokens > 0, "rollout.sglang.max_total_tokens", "must be > 0")
        _check(self.dtype in SGLANG_DTYPES, "rollout.sglang.dtype", f"must be one of {', '.join(SGLANG_DTYPES)} (SGLang's --dtype), got {self.dtype!r}")
        for name in ("startup_timeout_s", "request_timeout_s", "bucket_mb"):
            _check(getattr(self, name) > 0, f"rollout.sglang.{name}", "must be > 0")
        _check(
            self.max_concurrency >= 1 and self.max_batch_sequences >= 1,
            "rollout.sglang.max_concurrency",
            "max_concurrency and max_batch_sequences must be >= 1",
        )
        _check(self.max_restarts >= 0, "rollout.sglang.max_restarts", "must be >= 0")
        _check(self.weight_sync in WEIGHT_SYNC_MODES, "rollout.sglang.weight_sync", f"must be one of {', '.join(WEIGHT_SYNC_MODES)}, got {self.weight_sync!r}")
        _check(self.sync_backend in ("gloo", "nccl"), "rollout.sglang.sync_backend", f"must be gloo or nccl, got {self.sync_backend!r}")
        _check(self.pause_mode in PAUSE_MODES, "rollout.sglang.pause_mode", f"must be one of {', '.join(PAUSE_MODES)}, got {self.pause_mode!r}")
        bad = [u for u in self.urls.split(",") if u.strip() and not u.strip().startswith(("http://", "https://"))]
        _check(not bad, "rollout.sglang.urls", f"not an http(s) URL: {bad[0] if bad else ''!r}")


ENGINES = ("torch", "sglang")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollout with tools (miles_core/rollout/multi_turn.py), read when rollout.generate_fn
    is `miles_core.rollout.multi_turn:generate`; rollout.max_new_tokens caps each assistant turn."""

    max_turns: int = 3  # assistant turns per sample: at most max_turns - 1 tool calls
    max_response_tokens: int = 128  # budget of the whole response: the model's and the tools' tokens
    tools: str = "python,calc"  # tools the policy may call, comma-separated (miles_core.tools.TOOLS)
    max_tool_output_chars: int = 256  # a tool's output is cut to this before it becomes a turn
    tool_timeout_s: float = 5.0  # the python tool's wall-clock limit
    tool_cpu_s: int = 3
    tool_memory_mb: int = 256
    tool_workers: int = 2  # tool calls of one turn run concurrently

    def __post_init__(self):
        _check(self.max_turns >= 1, "rollout.multi_turn.max_turns", "must be >= 1")
        _check(self.max_response_tokens > 0, "rollout.multi_turn.max_response_tokens", "must be > 0")
        _check(all(t.strip() for t in self.tools.split(",")), "rollout.multi_turn.tools", f"empty tool name in {self.tools!r}")
        _check(self.max_tool_output_chars > 0, "rollout.multi_turn.max_tool_output_chars", "must be > 0")
        _check(self.tool_timeout_s > 0 and self.tool_cpu_s > 0 and self.tool_memory_mb > 0, "rollout.multi_turn.tool_timeout_s", "tool limits must be > 0")
        _check(self.tool_workers > 0, "rollout.multi_turn.tool_workers", "must be > 0")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "torch"
    prompts_per_step: int = 32
    n_samples: int = 8  # group size
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 8
    seed: int = 0
    dtype: str = "float32"  # float32 | bfloat16: the embedded torch engine's weights and compute (SGLang servers: sglang.dtype)
    routing_replay: bool = False  # R3: the engine records each token's experts (MoE models), the trainer replays them
    speculative_tokens: int = 0  # tokens the policy's MTP draft head drafts per forward pass, in either engine (docs/speculative.md); 0 = off
    generate_fn: str = "miles_core.step:generate"  # plug-point: generate(engine, prompts, tokenizer, params)
    # sampling control (DAPO dynamic sampling): keep generating until prompts_per_step groups pass
    # the filter, at most max_rounds rounds; each round asks for over_sample x the missing groups;
    # groups beyond the batch wait in a buffer for the next step
    dynamic_sampling: bool = False
    over_sample: float = 1.0
    max_rounds: int = 4
    rollout_fn: str = "miles_core.step:rollout"  # plug-point: rollout(engine, source, tokenizer, fns, scorer, buffer, seed)
    dynamic_filter_fn: str = "miles_core.algos.filters:nonzero_reward_std"  # plug-point: filter(group)
    buffer_filter_fn: str = "miles_core.algos.filters:oldest_first"  # plug-point: take(buffer, n)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # used when engine is sglang
    memory_gb: int = 0  # host memory of the rollout and evaluate pods, GiB; 0 = 64 per GPU they request, else the task's default
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tools and turn limits of multi-turn generate

    def __post_init__(self):
        check_finite(self, "rollout")
        _check(self.engine in ENGINES, "rollout.engine", f"unknown engine {self.engine!r} (available: {', '.join(ENGINES)})")
        _check(self.prompts_per_step > 0, "rollout.prompts_per_step", "must be > 0")
        _check(self.n_samples > 0, "rollout.n_samples", "must be > 0")
        _check(self.temperature > 0, "rollout.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", "must be > 0")
        _check(self.over_sample >= 1.0, "rollout.over_sample", "must be >= 1")
        _check(self.max_rounds >= 1, "rollout.max_rounds", "must be >= 1")
        _check(self.seed >= 0, "rollout.seed", "must be >= 0")
        _check(self.dtype in ("float32", "bfloat16"), "rollout.dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        _check(self.memory_gb >= 0, "rollout.memory_gb", f"must be >= 0 (GiB; 0 = sized from the GPUs), got {self.memory_gb}")
        _check(self.speculative_tokens >= 0, "rollout.speculative_tokens", f"must be >= 0 (0: off), got {self.speculative_tokens}")
        _check(
            self.speculative_tokens == 0 or not self.routing_replay,
            "rollout.speculative_tokens",
            "not with rollout.routing_replay: drafted positions are cropped from the cache, their routing would be recorded anyway",
        )
        sglang_spec = self.speculative_tokens > 0 and self.engine == "sglang"
        _check(
            not sglang_spec or self.sglang.weight_sync == "disk",
            "rollout.speculative_tokens",
            "with SGLang needs rollout.sglang.weight_sync: disk: each version's draft model is loaded from its directory",
        )
        _check(
            not sglang_spec or "--speculative-" not in self.sglang.extra_args,
            "rollout.speculative_tokens",
            "sets SGLang's --speculative-* flags itself (the policy's MTP head as the draft): remove them from rollout.sglang.extra_args",
        )

    def gpus(self) -> int:
        """GPUs of each rollout and evaluate pod: the SGLang servers it launches on cuda (attached servers and the torch engine: none)."""
        s = self.sglang
        launches = self.engine == "sglang" and s.device == "cuda" and not s.urls.strip()
        return s.num_servers * s.tensor_parallel if launches else 0
