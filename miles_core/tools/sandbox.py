"""Runs model-written Python in a contained, short-lived process.

Containment, layer by layer (each one tested by tests/unit/test_sandbox.py's hostile corpus):

* **bubblewrap** (`bwrap`, Debian package `bubblewrap`; `make setup` installs it) builds a new
  mount namespace whose root holds only a read-only `/usr` (the system Python and its standard
  library), `/proc`, a minimal `/dev` and a size-limited tmpfs scratch directory as the working
  directory. Nothing else of the host exists inside: not `/etc`, not `/root`, not the repository,
  not the project's virtual environment. The root is remounted read-only, so the scratch
  directory is the only writable place, and it vanishes with the sandbox.
* new **network** namespace (only its own loopback: no network, not even the host's 127.0.0.1), new **pid**,
  ipc and uts namespaces. When the sandbox's init dies the kernel kills every process left in
  its pid namespace, including daemons that called setsid() to leave the process group.
* the code runs as the unprivileged user `nobody` (uid 65534) with no capabilities and
  no_new_privs (`setpriv`), so it cannot signal the host's processes, read root-only files or
  regain privileges.
* **rlimits** (set by `prlimit` before bwrap starts, inherited by everything it forks):
  RLIMIT_CPU (CPU seconds per process), RLIMIT_AS (address space), RLIMIT_NPROC (processes of the sandbox user: a fork bomb
  stops there), RLIMIT_FSIZE (largest file), RLIMIT_NOFILE, RLIMIT_CORE = 0.
* the host side holds a **wall-clock** deadline and an **output** cap (stdout + stderr); past
  either, the whole process group is SIGKILLed (`--die-with-parent` then takes down the
  namespace). The sandbox is cleaned up on every path, including exceptions in the caller.

The sandbox needs root (to switch to `nobody`) or, without root, unprivileged user namespaces
(then the code runs as the invoking user mapped to `nobody`, and RLIMIT_NPROC counts the invoking
user's processes, so it is raised by their current count; this path is not exercised by the
tests, which run as root here). A missing `bwrap` or Python fails with
`SandboxUnavailable` naming what to install.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
# Outcomes of a run, from the most to the least specific.
OK, ERROR, TIMEOUT, OUTPUT_LIMIT, MEMORY_LIMIT, CPU_LIMIT, CRASHED = "ok", "error", "timeout", "output_limit", "memory_limit", "cpu_limit", "crashed"


class SandboxUnavailable(RuntimeError):
    """The machine lacks what the sandbox needs (bwrap, a system Python); the message says what."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0  # wall-clock seconds before the whole sandbox is killed
    cpu_s: int = 3  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 256  # address space per process (RLIMIT_AS)
    max_processes: int = 16  # processes of the sandbox user (RLIMIT_NPROC)
    max_file_mb: int = 4  # largest file the code may write (RLIMIT_FSIZE)
    scratch_mb: int = 16  # size of the scratch tmpfs
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 16384  # stdout + stderr kept; more kills the run
    python: str = "/usr/bin/python3"  # the system interpreter: only its standard library is visible

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb", "scratch_mb", "max_open_files", "max_output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    status: str  # ok | error | timeout | output_limit | memory_limit | cpu_limit | crashed
    exit_code: int  # the interpreter's exit code, 128 + signal when a signal ended it, -9 when killed here
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == OK

    def summary(self) -> str:
        """What a model sees: the output, or the error's last line and the reason."""
        if self.ok:
            return self.stdout
        reason = {
            TIMEOUT: "wall-clock limit reached", OUTPUT_LIMIT: "output limit reached", CPU_LIMIT: "CPU-time limit reached",
            MEMORY_LIMIT: "memory limit reached", CRASHED: f"crashed (exit {self.exit_code})",
        }.get(self.status, "")
        last = self.stderr.strip().splitlines()[-1] if self.stderr.strip() else ""
        return "\n".join(x for x in (self.stdout.rstrip(), last, f"[{self.status}] {reason}".rstrip()) if x)


def _command(limits: SandboxLimits, code_file: str) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap is not installed (no `bwrap` on PATH): `apt-get install bubblewrap` (make setup does)")
    if not os.path.isfile(limits.python) or not limits.python.startswith("/usr/"):
        raise SandboxUnavailable(f"sandbox python {limits.python!r} is not a file under /usr (the only tree mounted inside)")
    as_root = os.geteuid() == 0
    cmd = [
        bwrap, "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", str(limits.scratch_mb << 20), "--tmpfs", "/scratch",
        "--perms", "0755", "--dir", "/code", "--ro-bind", code_file, "/code/main.py", "--remount-ro", "/", "--chdir", "/scratch",
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--clearenv",
        "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/scratch", "--setenv", "TMPDIR", "/scratch",
        "--setenv", "PYTHONIOENCODING", "utf-8",
    ]
    if as_root:  # a real unprivileged uid: RLIMIT_NPROC counts only the sandbox's own processes
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs", "--bounding-set=-all"]
    else:  # without root, a user namespace maps the invoking user to nobody
        cmd += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        drop = []
    return [*cmd, *drop, limits.python, "-I", "-B", "/code/main.py"]


def _own_processes() -> int:
    uid = os.getuid()
    return sum(1 for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid)


def _uid_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _rlimits(limits: SandboxLimits, nproc: int) -> list[str]:
    """`prlimit` setting the limits before bwrap starts (an exec'd command rather than a
    preexec_fn, which is unsafe in a process with threads, such as a rollout's tool workers)."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        raise SandboxUnavailable("util-linux's `prlimit` is not on PATH: `apt-get install util-linux`")
    values = {
        "cpu": limits.cpu_s, "as": limits.memory_mb << 20, "nproc": nproc,
        "fsize": limits.max_file_mb << 20, "nofile": limits.max_open_files, "core": 0,
    }
    return [prlimit, *(f"--{name}={value}:{value}" for name, value in values.items()), "--"]


def _collect(proc: subprocess.Popen, limits: SandboxLimits, started: float) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until exit, the deadline or the output cap; returns (stdout, stderr, kill reason)."""
    chunks = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for pipe in chunks:
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            remaining = limits.wall_s - (time.monotonic() - started)
            if remaining <= 0:
                return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), TIMEOUT
            for key, _ in sel.select(timeout=remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                chunks[key.fileobj] += data
                if sum(len(c) for c in chunks.values()) > limits.max_output_bytes:
                    return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), OUTPUT_LIMIT
    try:
        proc.wait(timeout=max(limits.wall_s - (time.monotonic() - started), 0.01))
    except subprocess.TimeoutExpired:  # pipes closed by the code, process still running
        return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), TIMEOUT
    return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (bwrap and its monitor); the pid namespace takes the rest with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _status(exit_code: int, stderr: str, killed: str | None) -> str:
    if killed:
        return killed
    if exit_code == 0:
        return OK
    if exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):  # the kernel's RLIMIT_CPU signals
        return CPU_LIMIT
    if "MemoryError" in stderr:
        return MEMORY_LIMIT
    return CRASHED if exit_code > 128 else ERROR


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` (Python source) in a fresh sandbox; never raises for anything the code does."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sandbox-") as tmp:
        code_file = os.path.join(tmp, "main.py")
        with open(code_file, "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(tmp, 0o755)
        os.chmod(code_file, 0o644)
        nproc = limits.max_processes + (0 if os.geteuid() == 0 else _own_processes())
        sandbox = _command(limits, code_file)  # checks bwrap first: the dependency users must install
        cmd = _rlimits(limits, nproc) + sandbox
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err, killed = _collect(proc, limits, started)
        finally:
            _kill(proc)
            proc.stdout.close()
            proc.stderr.close()
    cap = limits.max_output_bytes
    stdout, stderr = out[:cap].decode("utf-8", "replace"), err[:cap].decode("utf-8", "replace")
    exit_code = -signal.SIGKILL if killed else proc.returncode
    return SandboxResult(_status(exit_code, stderr, killed), exit_code, stdout, stderr, time.monotonic() - started)
