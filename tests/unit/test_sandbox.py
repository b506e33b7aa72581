"""The sandbox's ordinary behaviour, its seccomp filter and its cgroup layout. Real bubblewrap,
real rlimits; the hostile corpus is tests/hostile/test_sandbox_corpus.py."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading

import pytest

from miles_core.tools import cgroup, seccomp
from miles_core.tools.runs import SandboxLimits
from miles_core.tools.sandbox import NOBODY, SLOT_LOCKS, UID_BASE, SandboxUnavailable, run_python

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=1, memory_mb=256, max_processes=16, max_output_bytes=8192)
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: make setup installs it")


@pytest.fixture
def host_server():
    """A TCP server on the host's loopback that records whether anyone connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    hits, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                hits.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], hits
    stop.set()
    thread.join(timeout=2)
    server.close()


def test_no_network_even_to_the_hosts_loopback(host_server):
    port, hits = host_server
    result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", LIMITS)
    assert result.status == "error" and "Connection refused" in result.stderr
    outside = run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", LIMITS)
    assert outside.status == "error" and "unreachable" in outside.stderr
    assert hits == []


def test_ordinary_code_runs_in_a_writable_scratch_directory():
    code = "import os\nopen('notes.txt', 'w').write('42')\nprint(os.getcwd(), open('notes.txt').read(), os.getuid())"
    result = run_python(code, LIMITS)
    assert result.ok and result.stdout.split() == ["/scratch", "42", str(NOBODY)]


def test_each_run_starts_from_an_empty_scratch():
    run_python("open('left_over.txt', 'w').write('x')", LIMITS)
    assert run_python("import os\nprint(os.listdir('.'))", LIMITS).stdout.strip() == "[]"


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes take uids of their own only as root")
def test_a_uid_held_by_a_process_with_another_tmpdir_is_held_for_this_one(tmp_path):
    """The uid slots are the machine's: a sandbox of a process with its own TMPDIR (`make run` gives it one) holds its
    uid in the same lock folder every other process looks in."""
    hold = "import sys\nfrom miles_core.tools.sandbox import _own_uid\nwith _own_uid() as uid:\n    print(uid, flush=True)\n    sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold], env={**os.environ, "TMPDIR": str(tmp_path)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        slot = int(holder.stdout.readline()) - UID_BASE
        with open(os.path.join(SLOT_LOCKS, str(slot)), "ab") as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.communicate("")
    assert not (tmp_path / "miles-sandbox-uids").exists()


def test_missing_bubblewrap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_python("print(1)", LIMITS)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "5", True])
def test_bad_limits_name_the_field(value):
    with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
        SandboxLimits(wall_s=value)


def test_code_that_is_not_text_is_a_clear_error():
    with pytest.raises(TypeError, match="code must be str or bytes, got int"):
        run_python(42, LIMITS)


def test_seccomp_filter_layout():
    """x86_64: arch check (3 insns), x32 check (2), one comparison per denied call, allow, deny.
    Every comparison jumps, on a match, to the last instruction (return EPERM = 0x50001)."""
    raw = seccomp.deny_filter("x86_64")
    program = [struct.unpack_from("=HBBI", raw, i) for i in range(0, len(raw), 8)]
    assert len(program) == 4 + 2 + len(seccomp.DENIED) + 2
    assert program[-1] == (0x06, 0, 0, 0x50001) and program[-2] == (0x06, 0, 0, 0x7FFF0000)
    compares = program[6:-2]
    assert [k for _, _, _, k in compares][:3] == [250, 248, 249]  # keyctl, add_key, request_key
    assert all(i + 6 + jt + 1 == len(program) - 1 for i, (_, jt, _, _) in enumerate(compares))
    assert len(seccomp.deny_filter("aarch64")) == 8 * (4 + len(seccomp.DENIED) + 2)  # no x32 check there
    with pytest.raises(seccomp.SeccompUnsupported, match="riscv64"):
        seccomp.deny_filter("riscv64")


def test_cgroup_v2_layout_on_a_stand_in_tree(tmp_path, monkeypatch):
    """cgroup v2 cannot be mounted here (the host is v1), so a directory tree stands in for it:
    the run's group is made under this process's own group, with memory.max, swap off and pids.max."""
    own = cgroup.own_group("")  # this process's v2 path (the stand-in mirrors it)
    parent = tmp_path / own.lstrip("/")
    parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text("memory pids")
    (parent / "cgroup.subtree_control").write_text("memory pids")
    group = cgroup.create(100 << 20, 7, root=tmp_path)
    assert group.version == 2 and group.controllers == ("memory", "pids")
    made = group.dirs["memory"]
    assert made.parent == parent
    assert ((made / "memory.max").read_text(), (made / "pids.max").read_text()) == (str(100 << 20), "7")
    (made / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_killed()
    for f in made.iterdir():
        f.unlink()
    group.close()
    assert not made.exists()


def test_cgroup_v2_without_delegation_applies_nothing(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory pids")
    parent = tmp_path / cgroup.own_group("").lstrip("/")
    parent.mkdir(parents=True, exist_ok=True)
    (parent / "cgroup.subtree_control").write_text("cpu")
    assert cgroup.create(1 << 20, 4, root=tmp_path).controllers == ()
