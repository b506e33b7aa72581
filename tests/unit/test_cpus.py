"""miles_core/cpus.py: the CPUs a process may use, from its affinity and a (fake) cgroup's quota."""

import os

import pytest

from miles_core.cpus import threads_per_process, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1),  # 1.5 CPUs: a second thread would be throttled
        ({"cpu.max": "50000 100000\n"}, 1),  # below one CPU: still one thread
        ({"cpu.max": "400000 100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 2),
        ({}, None),  # no cgroup CPU controller at all
    ],
)
def test_usable_cpus_is_the_smaller_of_affinity_and_quota(tmp_path, files, quota):
    expected = AFFINITY if quota is None else max(1, min(AFFINITY, quota))
    assert usable_cpus(write(tmp_path, files)) == expected


def test_usable_cpus_follows_the_affinity(tmp_path):
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert usable_cpus(write(tmp_path, {"cpu.max": "max 100000\n"})) == 1
    finally:
        os.sched_setaffinity(0, before)


def test_processes_share_the_cpus_and_each_gets_at_least_one_thread(tmp_path):
    root = write(tmp_path, {"cpu.max": "800000 100000\n"})
    cpus = usable_cpus(root)
    assert threads_per_process(1, root) == cpus
    assert threads_per_process(2, root) == max(1, cpus // 2)
    assert threads_per_process(cpus + 5, root) == 1
