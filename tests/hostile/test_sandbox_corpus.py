"""The sandbox against a corpus of hostile programs, each saying what it would have done.

Real bubblewrap, cgroups, rlimits and seccomp; nothing is mocked. A probe prints `BLOCKED` when
the attack's call failed and `ESCAPED` when it went through; the test asserts the specific
containment (the probe's call failed, the run ended with the limit's status, the host's file,
process, server or keyring is untouched), not just that nothing raised. The corpus runs two at a
time in a pool (the machine has 2 cores) and checks the host once all have run.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from miles_core.tools import cgroup, seccomp
from miles_core.tools.runs import SandboxLimits
from miles_core.tools.sandbox import SLOT_LOCKS, UID_BASE, UID_SLOTS, run_python
from tests.hostile.sandbox_programs import CLONE_NEWNS, CLONE_NEWUSER, CORPUS, ENCODINGS, NR, PRELUDE, Hostile

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=1, memory_mb=256, max_processes=16, max_output_bytes=8192)
SECRET = "miles-host-secret-4f1c"  # set in the host's environment and session keyring: must never show up inside
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: make setup installs it")


def _memory_cgroup() -> bool:
    group = cgroup.create(64 << 20, 8)
    try:
        return "memory" in group.controllers
    finally:
        group.close()


def _run(hostile: Hostile, subs: dict[str, str]):
    code = hostile.code
    for key, value in subs.items():
        code = code.replace(key, value)
    return run_python(PRELUDE + code, LIMITS)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The host's side: a canary file, a loopback server, an abstract socket, a sleeper process, a
    secret in the environment and one in the session keyring; then the whole corpus, run two at a time."""
    canary = tmp_path_factory.mktemp("host") / "canary.txt"
    canary.write_text("original")
    server = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0miles-sandbox-canary")
    abstract.listen()
    for s in (server, abstract):
        s.settimeout(0.2)
    hits, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            for s in (server, abstract):
                try:
                    hits.append(s.accept())
                except OSError:
                    continue

    watcher = threading.Thread(target=accept, daemon=True)
    watcher.start()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    os.environ["MILES_TEST_SECRET"] = SECRET
    key = _add_session_key(SECRET)
    subs = {
        "CANARY": repr(str(canary)),
        "PORT": str(server.getsockname()[1]),
        "ABSTRACT": repr(b"\0miles-sandbox-canary"),
        "HOST_PID": str(os.getpid()),
        "SLEEPER_PID": str(sleeper.pid),
        "HOSTNAME": repr(socket.gethostname()),
        "SECRET": repr(SECRET),
        "NR": repr(NR),
        "CLONE_NEWUSER": str(CLONE_NEWUSER),
        "CLONE_NEWNS": str(CLONE_NEWNS),
    }
    try:
        with ThreadPoolExecutor(2) as pool:
            results = dict(zip([c.name for c in CORPUS], pool.map(lambda c: _run(c, subs), CORPUS)))
        yield {"results": results, "canary": canary, "hits": hits, "sleeper": sleeper, "key": key}
    finally:
        del os.environ["MILES_TEST_SECRET"]
        stop.set()
        watcher.join(timeout=2)
        server.close()
        abstract.close()
        sleeper.kill()
        sleeper.wait()


def _add_session_key(payload: str) -> int:
    """add_key("user", ..., @s) in this process's session keyring; returns the key's serial."""
    libc = ctypes.CDLL(None, use_errno=True)
    serial = libc.syscall(seccomp.syscall_number("add_key"), b"user", b"miles-test-secret", payload.encode(), len(payload), -3)
    assert serial > 0, os.strerror(ctypes.get_errno())
    return serial


def _read_key(serial: int) -> bytes:
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(256)
    size = libc.syscall(seccomp.syscall_number("keyctl"), 11, serial, buffer, 256)  # KEYCTL_READ
    return buffer.raw[:size]


def test_corpus_is_large_and_explained():
    names = [c.name for c in CORPUS] + [e[0] for e in ENCODINGS]
    assert len(names) >= 60 and len(set(names)) == len(names)
    assert all(c.why for c in CORPUS)


@pytest.mark.parametrize("hostile", CORPUS, ids=[c.name for c in CORPUS])
def test_hostile_program_is_contained(host, hostile):
    if hostile.needs_memory_cgroup and not _memory_cgroup():
        pytest.skip("no writable memory cgroup here: total memory is capped by RLIMIT_AS per process and the seccomp filter only")
    result = host["results"][hostile.name]
    output = result.stdout + result.stderr
    assert result.status in hostile.statuses, f"{hostile.name} (would {hostile.why}): {result.status} {output[-500:]}"
    assert hostile.expect in output, f"{hostile.name} (would {hostile.why}): {output[-500:]}"
    assert "ESCAPED" not in result.stdout, f"{hostile.name} escaped: would {hostile.why}: {result.stdout[-500:]}"
    assert result.seconds < LIMITS.wall_s + 2  # the wall-clock limit held (plus start-up and cleanup)


def test_host_is_untouched(host):
    """After the whole corpus: the canary file, the sleeper, the servers and the session key are as they were."""
    assert host["canary"].read_text() == "original"
    assert host["sleeper"].poll() is None  # still running
    assert host["hits"] == []  # no connection reached the host's loopback or abstract socket
    assert _read_key(host["key"]) == SECRET.encode()


def test_no_sandbox_process_outlives_its_run(host):
    """No process of a sandbox uid is left (daemons, lingering children) once its sandbox has ended: a uid whose
    slot lock nobody holds. A slot still held belongs to a sandbox running now (another test process's)."""
    left = [p for p in os.listdir("/proc") if p.isdigit() and UID_BASE <= _uid(p) < UID_BASE + UID_SLOTS and not _slot_held(_uid(p) - UID_BASE)]
    assert left == []


def _slot_held(slot: int) -> bool:
    with open(os.path.join(SLOT_LOCKS, str(slot)), "ab") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


@pytest.mark.parametrize("name,code,statuses,text", ENCODINGS, ids=[e[0] for e in ENCODINGS])
def test_any_bytes_of_code_give_a_result(name, code, statuses, text):
    result = run_python(code, LIMITS)
    assert result.status in statuses and text in result.stdout + result.stderr, (result.status, result.stderr[-300:])


def test_nothing_persists_between_runs():
    """A file in scratch, /dev/shm or the user keyring written by one run is gone in the next."""
    plant = "open('/scratch/mark', 'w').write('x')\nopen('/dev/shm/mark', 'w').write('x')\nprint('PLANTED')"
    look = "import os\nprint('FOUND' if os.path.exists('/scratch/mark') or os.path.exists('/dev/shm/mark') else 'GONE')"
    assert "PLANTED" in run_python(plant, LIMITS).stdout
    assert run_python(look, LIMITS).stdout.strip() == "GONE"


@pytest.mark.parametrize(
    "attack",
    [
        "import os\nwhile True:\n    os.fork()",  # fork bomb: must not use up the neighbour's process count
        "import time\nx = []\nwhile True:\n    x.append(bytearray(10 << 20))",  # memory hog: must not take the neighbour's memory
    ],
    ids=["fork bomb", "memory hog"],
)
def test_a_hostile_sandbox_does_not_starve_a_concurrent_one(attack):
    """While one sandbox attacks, a neighbour started at the same time still forks its 8 workers and finishes."""
    neighbour = "import os\npids = [os.fork() or os._exit(0) for _ in range(8)]\nprint('DONE', sum(os.waitpid(p, 0)[1] == 0 for p in pids))"
    with ThreadPoolExecutor(2) as pool:
        hostile, good = pool.map(lambda code: run_python(code, LIMITS), [attack, neighbour])
    assert hostile.status != "ok"
    assert good.status == "ok" and good.stdout.strip() == "DONE 8", good.stderr[-300:]
