"""The sandbox against a corpus of hostile snippets: each ends within its limit, with a clear
status, and leaves no process behind. Real bubblewrap, real rlimits, nothing mocked."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from miles_core.tools.sandbox import NOBODY, SandboxLimits, SandboxUnavailable, run_python

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=1, memory_mb=256, max_processes=16, max_output_bytes=8192)
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing: make setup installs it")


def _sandbox_processes() -> list[str]:
    """Processes of the sandbox user still alive (zombies included)."""
    return [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) == NOBODY]


def _uid(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


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


# (name, code, expected status, text the result must contain). The README's table lists these.
CORPUS = [
    ("infinite loop", "while True:\n    pass", ("cpu_limit", "timeout"), ""),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", ("error",), "Resource temporarily unavailable"),
    ("memory bomb", "x = bytearray(2 << 30)", ("memory_limit",), "MemoryError"),
    ("growing list", "x = []\nwhile True:\n    x.append('a' * 10**6)", ("memory_limit",), "MemoryError"),
    ("read /etc/shadow", "print(open('/etc/shadow').read())", ("error",), "No such file"),
    ("read the repository", f"print(open({str(REPO / 'pyproject.toml')!r}).read())", ("error",), "No such file"),
    ("read the host through /proc", "print(open('/proc/1/root/etc/passwd').read())", ("error",), "Permission denied"),
    ("write outside scratch", "open('/usr/pwned', 'w').write('x')", ("error",), "Read-only file system"),
    ("write at the root", "open('/pwned', 'w').write('x')", ("error",), "Read-only file system"),
    ("fill the disk", "open('big', 'wb').write(b'0' * (64 << 20))", ("crashed", "error"), ""),
    ("huge print", "print('a' * 10**8)", ("output_limit", "memory_limit"), ""),
    ("endless print", "while True:\n    print('spam' * 100)", ("output_limit",), ""),
    ("ctypes segfault", "import ctypes\nctypes.string_at(0)", ("crashed",), "crashed"),
    ("ignore SIGTERM", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)", ("timeout",), ""),
    ("kill the parent", "import os\nos.kill(os.getppid(), 9)\nprint('alive')", ("error",), "Operation not permitted"),
    ("kill everything", "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')", ("error",), "No such process"),
    ("detached daemon", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')", ("ok",), "parent done"),
    ("close the pipes and linger", "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", ("timeout",), ""),
    ("syntax error", "def (:", ("error",), "SyntaxError"),
]


@pytest.mark.parametrize("name,code,statuses,text", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_snippet_is_contained(name, code, statuses, text):
    before = set(_sandbox_processes())  # processes of the sandbox user that are not this run's
    started = time.monotonic()
    result = run_python(code, LIMITS)
    assert result.status in statuses, (result.status, result.exit_code, result.stderr[-500:])
    assert text in result.summary()
    assert time.monotonic() - started < LIMITS.wall_s + 2.0  # the limit, plus starting and killing
    assert len(result.stdout) <= LIMITS.max_output_bytes and len(result.stderr) <= LIMITS.max_output_bytes
    deadline = time.monotonic() + 2.0
    while set(_sandbox_processes()) - before and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel reaps the pid namespace asynchronously
    assert set(_sandbox_processes()) - before == set()


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


def test_missing_bubblewrap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_python("print(1)", LIMITS)


def test_bad_limits_name_the_field():
    with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
        SandboxLimits(wall_s=0)
