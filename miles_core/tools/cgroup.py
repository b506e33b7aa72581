"""One control group per sandbox run: the total memory and the process count of the whole sandbox.

RLIMIT_AS caps one process's address space, RLIMIT_NPROC counts the processes of a uid: neither
caps what a sandbox holds in total (many processes, tmpfs files, shared memory). A memory cgroup
charges every page the sandbox's processes touch (anonymous memory, tmpfs, SysV shm, memfd) and
its OOM killer ends the sandbox at the limit; a pids cgroup counts only this sandbox's processes.

Where: cgroup v2 (`/sys/fs/cgroup/cgroup.controllers` exists) under this process's own cgroup,
when its `cgroup.subtree_control` already delegates `memory` and `pids`; otherwise cgroup v1,
each of the `memory` and `pids` hierarchies under this process's own group in it. A hierarchy
that is absent or not writable is skipped: `SandboxCgroup.controllers` says what was applied
(the sandbox then falls back on rlimits and its seccomp filter, see sandbox.py).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
OPTIONAL = {"memory.memsw.limit_in_bytes", "memory.swap.max"}  # absent without swap accounting: nothing to cap then


@dataclass
class SandboxCgroup:
    dirs: dict[str, Path]  # controller ("memory", "pids") -> this run's group directory (both the same dir on v2)
    version: int  # 1 or 2

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.dirs))

    @property
    def procs_files(self) -> list[str]:
        """Files the launcher writes its pid into before starting bwrap (its children inherit the group)."""
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this group for reaching the memory limit."""
        if "memory" not in self.dirs:
            return False
        events = self.dirs["memory"] / ("memory.events" if self.version == 2 else "memory.oom_control")
        try:
            counts = dict(line.split() for line in events.read_text().splitlines() if len(line.split()) == 2)
        except OSError:
            return False
        return int(counts.get("oom_kill", "0")) > 0

    def close(self) -> None:
        """Kill whatever is left in the group and remove it."""
        for d in {*self.dirs.values()}:
            _kill_members(d)
            _remove(d)


def own_group(controller: str) -> str | None:
    """This process's group path in the named v1 hierarchy ('' = the v2 unified one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(",") or (controller == "" and names == ""):
            return path
    return None


def _make(parent: Path, name: str, limits: dict[str, int | str]) -> Path | None:
    """Create parent/name and write its limits; None (and nothing left behind) when the host refuses."""
    group = parent / name
    try:
        group.mkdir()
    except OSError:
        return None
    try:
        for file, value in limits.items():
            if file not in OPTIONAL or (group / file).exists():
                (group / file).write_text(str(value))
    except OSError:
        _remove(group)
        return None
    return group


def create(memory_bytes: int, max_pids: int, root: Path = ROOT) -> SandboxCgroup:
    """A fresh group with `memory_bytes` of memory (swap included) and `max_pids` processes."""
    name = f"miles-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if (root / "cgroup.controllers").exists():  # v2: one group holds both limits
        parent = root / (own_group("") or "/").lstrip("/")
        try:
            delegated = set((parent / "cgroup.subtree_control").read_text().split())
        except OSError:
            delegated = set()
        group = _make(parent, name, {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": max_pids}) if {"memory", "pids"} <= delegated else None
        return SandboxCgroup({"memory": group, "pids": group} if group else {}, 2)
    dirs = {}
    # v1: memsw (memory + swap) may only be set once the memory limit is at most its value
    for controller, limits in (
        ("memory", {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}),
        ("pids", {"pids.max": max_pids}),
    ):
        own = own_group(controller)
        if own is not None and (root / controller).is_dir():
            group = _make(root / controller / own.lstrip("/"), name, limits)
            if group is not None:
                dirs[controller] = group
    return SandboxCgroup(dirs, 1)


def _kill_members(group: Path) -> None:
    if (group / "cgroup.kill").exists():
        try:
            (group / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
    try:
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove(group: Path, patience_s: float = 2.0) -> None:
    """rmdir, retried while the killed members are still being reaped (the kernel answers EBUSY)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # left for the host to reap; it holds no process and no limit applies to anyone else
            time.sleep(0.01)
