"""How many CPUs this process may really use, and how many compute threads each of the processes sharing them gets.

`os.cpu_count()` (and torch's default thread count) is the machine's: in a container limited by a CPU quota, or a
process pinned to a few cores, threads beyond the allowance only wait for each other. The allowance is the smaller
of the CPU affinity and the cgroup's quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`, as a container
sees its own cgroup at /sys/fs/cgroup), rounded down (a thread beyond the quota is throttled), at least 1.
It is decided from these limits only, never from the current load, so a run computes with the same thread count
(and the same floating-point results) whatever else runs beside it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _quota(cgroup_root: Path) -> float | None:
    """CPUs allowed by the cgroup's quota, or None when it sets none (v2 first, then v1)."""
    v2 = cgroup_root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().partition(" ")
        return None if quota.strip() == "max" else int(quota) / int(period or 100000)
    v1 = cgroup_root / "cpu" / "cpu.cfs_quota_us"
    if not v1.is_file():
        v1 = cgroup_root / "cpu,cpuacct" / "cpu.cfs_quota_us"
    if v1.is_file():
        quota = int(v1.read_text())
        return None if quota <= 0 else quota / int((v1.parent / "cpu.cfs_period_us").read_text())
    return None


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """min(CPUs in this process's affinity, the cgroup's CPU quota rounded down), at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _quota(Path(cgroup_root))
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def threads_per_process(processes: int, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Compute threads of each of `processes` processes sharing this process's CPUs: an equal share, at least 1."""
    return max(1, usable_cpus(cgroup_root) // max(1, processes))


def thread_environment(processes: int = 1, cgroup_root: Path = CGROUP_ROOT) -> dict[str, str]:
    """The environment of a process the project starts beside `processes - 1` others on these CPUs: its share of
    threads, and OpenMP threads that sleep when they wait instead of spinning (a spinning thread takes the core that
    another process, or a thread descheduled mid-operation, needs; results are the same bit for bit). Both are read
    once, when OpenMP starts in the process (importing torch), so they must be in place before that."""
    return {"OMP_NUM_THREADS": str(threads_per_process(processes, cgroup_root)), "OMP_WAIT_POLICY": "PASSIVE"}
