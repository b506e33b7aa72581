"""What a sandboxed run (tools/sandbox.py) may use, `SandboxLimits`, and what it gave, `SandboxResult`: its outcome,
output and what a model is shown of it."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Outcomes of a run, from the most to the least specific.
OK, ERROR, TIMEOUT, OUTPUT_LIMIT, MEMORY_LIMIT, CPU_LIMIT, CRASHED = "ok", "error", "timeout", "output_limit", "memory_limit", "cpu_limit", "crashed"


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0  # wall-clock seconds before the whole sandbox is killed
    cpu_s: int = 3  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 256  # address space per process (RLIMIT_AS); the whole sandbox's memory cgroup holds this + scratch_mb + 1 MiB of /dev/shm
    max_processes: int = 16  # processes of this sandbox, its interpreter included (pids cgroup and RLIMIT_NPROC of its own uid)
    max_file_mb: int = 4  # largest file the code may write (RLIMIT_FSIZE)
    scratch_mb: int = 16  # size of the scratch tmpfs
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 16384  # stdout + stderr kept; more kills the run
    python: str = "/usr/bin/python3"  # the system interpreter: only its standard library is visible

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_file_mb", "scratch_mb", "max_open_files", "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"SandboxLimits.{name} must be a finite number > 0, got {value!r}")


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
            TIMEOUT: "wall-clock limit reached",
            OUTPUT_LIMIT: "output limit reached",
            CPU_LIMIT: "CPU-time limit reached",
            MEMORY_LIMIT: "memory limit reached",
            CRASHED: f"crashed (exit {self.exit_code})",
        }.get(self.status, "")
        stderr = self.stderr
        if self.status == OUTPUT_LIMIT:  # stopped mid-write: its last line may be cut, the one before is whole
            stderr = stderr[: stderr.rfind("\n") + 1] or stderr
        return "\n".join(x for x in (self.stdout.rstrip(), _error_line(stderr), f"[{self.status}] {reason}".rstrip()) if x)


def _error_line(stderr: str) -> str:
    """The line of stderr that names the error: the last one a traceback would end with (not
    indented, not a traceback's header), else the last line. A program's child processes write
    to the same pipe, so their tracebacks interleave and the last line may be one of a frame's."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    named = [line for line in lines if not line[0].isspace() and not line.startswith("Traceback (")]
    return (named or lines or [""])[-1]
