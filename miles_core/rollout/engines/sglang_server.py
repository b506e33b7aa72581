"""One SGLang server process (or an attached URL): launch, health wait, HTTP calls with timeouts, restart.

A server runs in SGLang's own environment (`make sglang-env`, its CUDA torch stack), never in the
project's: it is started as `python -m sglang.launch_server` from that environment's python, on
127.0.0.1, in its own session so that stopping it ends its scheduler and detokenizer too. On CPU it
runs with SGLANG_USE_CPU_ENGINE=1, which activates the stand-ins of containers/sglang there.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

# HTTP client for the servers' REST API; requests ships with the project's environment (flytekit, mlflow).
import requests

from miles_core.config import SGLangConfig
from miles_core.net import free_port

SGLANG_VERSION = "0.5.23"  # the version `make sglang-env` installs and the CPU stand-ins are pinned to
log = logging.getLogger(__name__)


class SGLangError(RuntimeError):
    """An SGLang server failed to start, answer in time, or do what it was asked."""


def sglang_python(cfg: SGLangConfig) -> str:
    """The SGLang environment's python: rollout.sglang.python, else $MILES_SGLANG_ENV, else the
    per-user cache folder `make sglang-env` builds. Fails naming the fix when it is missing."""
    if cfg.python:
        python = Path(cfg.python)
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        env = Path(os.environ.get("MILES_SGLANG_ENV") or cache / "miles-flyte" / f"sglang-{SGLANG_VERSION}")
        python = env / "bin" / "python"
    if not python.is_file():
        raise SGLangError(f"no SGLang environment at {python}: run `make sglang-env` (or set rollout.sglang.python)")
    return str(python)


def launch_args(cfg: SGLangConfig, model_path: str, port: int, weight_version: int, slot: int = 0) -> list[str]:
    """`python -m sglang.launch_server` arguments of server number `slot`: on cuda each server has tensor_parallel GPUs
    of its own (--tp-size, from --base-gpu-id slot x tensor_parallel), so the pod's servers never share a GPU."""
    gpus = ["--base-gpu-id", str(slot * cfg.tensor_parallel)] if cfg.device == "cuda" else []
    return [
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        cfg.device,
        "--tp-size",
        str(cfg.tensor_parallel),
        *gpus,
        "--dtype",
        cfg.dtype,
        "--max-total-tokens",
        str(cfg.max_total_tokens),
        "--skip-tokenizer-init",
        "--weight-version",
        str(weight_version),
        *(["--sleep-on-idle"] if cfg.sleep_on_idle else []),
        *shlex.split(cfg.extra_args),
    ]


class SGLangServer:
    """A launched server (`launch`) or one reached by URL (`attach`); `post` raises SGLangError."""

    def __init__(self, url: str, cfg: SGLangConfig, process: subprocess.Popen | None = None, log_file: Path | None = None):
        self.url = url.rstrip("/")
        self.cfg = cfg
        self.process = process
        self.log_file = log_file
        self.restarts = 0
        self.slot = 0  # a launched server's place among the pod's servers (its GPUs on cuda)
        self._session = requests.Session()

    @classmethod
    def attach(cls, url: str, cfg: SGLangConfig) -> SGLangServer:
        server = cls(url, cfg)
        server.wait_healthy()
        return server

    @classmethod
    def launch(cls, cfg: SGLangConfig, model_path: str, weight_version: int, slot: int = 0) -> SGLangServer:
        """Start server number `slot` of this pod (on cuda: GPUs slot x tensor_parallel onwards) and wait until it is
        healthy; a port another process bound first (the server binds it only after its engine has started) is
        given up for another, up to three times."""
        for attempt in range(1, _LAUNCH_TRIES + 1):
            server = cls._start(cfg, model_path, weight_version, slot)
            try:
                server.wait_healthy()
                return server
            except PortTaken:
                server.stop()
                if attempt == _LAUNCH_TRIES:
                    raise
                log.warning("%s was taken before the SGLang server bound it: starting it again on another port", server.url)
            except BaseException:
                server.stop()
                raise

    @classmethod
    def _start(cls, cfg: SGLangConfig, model_path: str, weight_version: int, slot: int) -> SGLangServer:
        port = free_port()
        log_file = Path(tempfile.mkdtemp(prefix="sglang-")) / f"server-{port}.log"
        command = [sglang_python(cfg), *launch_args(cfg, model_path, port, weight_version, slot)]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1" if cfg.device == "cpu" else "0"}
        if cfg.device == "cpu":  # no GPU to diagnose: a failed start exits at once instead of after ~65 s of py-spy / CUDA coredump waits
            env = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"} | env
        log.info("starting SGLang server on port %d (log %s)", port, log_file)
        with open(log_file, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = cls(f"http://127.0.0.1:{port}", cfg, process, log_file)
        server.slot = slot
        return server

    @property
    def launched(self) -> bool:
        return self.process is not None

    def alive(self) -> bool:
        """A launched server's process is running; an attached one answers /health."""
        if self.process is not None:
            return self.process.poll() is None
        try:
            return self._session.get(f"{self.url}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, lines: int = 15) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self) -> None:
        """Poll /health until it answers 200, the process exits, or startup_timeout_s passes. A launched server that
        found its port taken raises PortTaken at once: its HTTP server gives up but the process stays."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            tail = self.log_tail() if self.process is not None else ""
            if _PORT_TAKEN in tail.lower():
                raise PortTaken(f"SGLang server {self.url}: its port was taken (log {self.log_file}):\n{tail}")
            if self.process is not None and self.process.poll() is not None:
                raise SGLangError(
                    f"SGLang server {self.url} exited with code {self.process.returncode} during start-up (log {self.log_file}):\n{self.log_tail()}"
                )
            try:
                if self._session.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise SGLangError(
            f"SGLang server {self.url} not healthy within rollout.sglang.startup_timeout_s="
            f"{self.cfg.startup_timeout_s:g}s" + (f" (log {self.log_file}):\n{self.log_tail()}" if self.log_file else "")
        )

    def post(self, path: str, payload: dict | None = None, timeout: float | None = None):
        """POST JSON, return the decoded answer; a refusal, an error status or a timeout raises SGLangError."""
        timeout = timeout or self.cfg.request_timeout_s
        try:
            response = self._session.post(f"{self.url}{path}", json=payload or {}, timeout=(10, timeout))
        except requests.Timeout:
            raise SGLangError(f"{self.url}{path}: no answer within {timeout:g}s (rollout.sglang.request_timeout_s)") from None
        except requests.ConnectionError as err:
            raise ServerUnreachable(f"{self.url}{path}: server unreachable ({err.__class__.__name__})") from None
        if response.status_code != 200:
            raise SGLangError(f"{self.url}{path}: HTTP {response.status_code}: {response.text[:500]}")
        if "json" not in response.headers.get("content-type", ""):
            return response.text  # /flush_cache answers in plain text
        answer = response.json()
        if isinstance(answer, dict) and answer.get("success") is False:
            raise SGLangError(f"{self.url}{path}: {answer.get('message')}")
        return answer

    def restart(self, model_path: str, weight_version: int) -> None:
        """Stop what is left of a launched server and start it again on a new port."""
        if self.process is None:
            raise SGLangError(f"attached SGLang server {self.url} is down and cannot be restarted from here")
        self.stop()
        fresh = SGLangServer.launch(self.cfg, model_path, weight_version, self.slot)
        self.url, self.process, self.log_file = fresh.url, fresh.process, fresh.log_file
        self.restarts += 1

    def stop(self) -> None:
        """End a launched server's whole process group (server, scheduler, detokenizer)."""
        if self.process is None or self.process.poll() is not None and not _group_alive(self.process.pid):
            return
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
                if not _group_alive(self.process.pid):
                    return
            except subprocess.TimeoutExpired:
                pass


class PortTaken(SGLangError):
    """Another process bound a launched server's port before it did."""


_PORT_TAKEN = "address already in use"
_LAUNCH_TRIES = 3  # ports a launch tries before PortTaken fails it


class ServerUnreachable(SGLangError):
    """The connection failed: the server is down (dead process, wrong URL)."""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
