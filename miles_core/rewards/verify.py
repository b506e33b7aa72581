"""A deadline for answer verification that holds on any thread: a small pool of worker processes.

math-verify's own timeouts use SIGALRM, which only the main thread may set (scoring runs in Ray
actors and thread pools), and no signal interrupts a long C-level computation such as sympy's
power of a huge integer. So each verification runs in a worker process; the caller waits on a
pipe with a deadline and kills a worker that misses it (the next call starts a fresh one).

Workers are fresh interpreters started lazily, at most `size` at a time, each serving one call
at a time; one that missed a deadline or died is replaced by the next call.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # importing sympy in a fresh process on a loaded machine


class VerificationFailed(RuntimeError):
    """A worker did not answer: it missed its deadline or died (e.g. killed for memory); it is replaced."""


class VerificationTimeout(VerificationFailed, TimeoutError):
    """A verification did not finish within its deadline; its worker was killed."""


def _function(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def serve(target: str) -> None:
    """A worker's loop (run as `python -c`): import `target` ("pkg.mod:fn") once, then answer each
    args tuple read from stdin with fn(*args) on stdout; stdout proper goes to stderr."""
    requests, replies = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # a library's print must not corrupt the replies
    fn = _function(target)
    replies.send("ready")
    while True:
        try:
            args = requests.recv()
        except EOFError:  # the caller closed the pipe or exited
            return
        try:
            replies.send((True, fn(*args)))
        except Exception as err:  # noqa: BLE001 - any error of the target is sent back and raised in the caller
            replies.send((False, err))


class _Worker:
    """One worker process, started with `python -c` rather than multiprocessing: a spawned or
    forkserver child re-runs the caller's __main__ (a script, Ray's worker loop); a forked one
    inherits threads and locks held in the parent."""

    def __init__(self, target: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = f"from miles_core.rewards.verify import serve; serve({target!r})"
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.requests = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self.replies = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        if not self.replies.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"answer-verification worker for {target} did not start within {STARTUP_TIMEOUT_S}s")
        try:
            self.replies.recv()
        except EOFError as err:
            self.kill()
            raise RuntimeError(f"answer-verification worker for {target} failed to start (exit code {self.process.poll()})") from err

    def call(self, args: tuple, timeout_s: float):
        try:
            self.requests.send(args)
            answered = self.replies.poll(timeout_s)
            ok, value = self.replies.recv() if answered else (True, None)
        except (EOFError, OSError) as err:
            raise VerificationFailed(f"the verification worker died (exit code {self._exit_code()})") from err
        if not answered:
            raise VerificationTimeout(f"verification did not finish within {timeout_s}s")
        if not ok:
            raise value
        return value

    def _exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=5.0)  # it closed its pipe: it is exiting
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.requests, self.replies, self.process.stdin, self.process.stdout):
            pipe.close()


class WorkerPool:
    """Runs `target(*args)` ("pkg.mod:fn", importable in a fresh process) in worker processes."""

    def __init__(self, target: str, size: int):
        if size < 1:
            raise ValueError(f"WorkerPool size must be >= 1, got {size}")
        self.target = target
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._free_slots = threading.BoundedSemaphore(size)

    def call(self, *args, timeout_s: float):
        """`target(*args)` from a worker; raises VerificationTimeout past `timeout_s` seconds and
        VerificationFailed when the worker died (either worker is replaced), or what `target` raised."""
        with self._free_slots:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = _Worker(self.target)
            try:
                result = worker.call(args, timeout_s)
            except VerificationFailed:
                worker.kill()
                raise
            except Exception:
                self._idle.put(worker)
                raise
            self._idle.put(worker)
            return result

    def close(self) -> None:
        """Stops the idle workers (a later call starts new ones)."""
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


_pools: dict[str, WorkerPool] = {}
_pools_lock = threading.Lock()


def shared_pool(target: str) -> WorkerPool:
    """The process-wide pool for `target`, created on first use (at most 4 workers, one per core)."""
    with _pools_lock:
        if target not in _pools:
            _pools[target] = WorkerPool(target, size=min(4, os.cpu_count() or 1))
        return _pools[target]
