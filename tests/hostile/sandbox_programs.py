"""The hostile programs of tests/hostile/test_sandbox_corpus.py, each saying what it would have done.

A probe prints `BLOCKED` when the attack's call failed and `ESCAPED` when it went through. Upper-case names in a
program (PORT, ABSTRACT, HOSTNAME, SLEEPER_PID, ...) are the host's values, put in by the test before it runs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from miles_core.tools import seccomp

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """import os, sys, ctypes, socket, signal, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def attempt(action):
    try:
        out = action()
    except BaseException as err:
        print("BLOCKED", type(err).__name__, err)
    else:
        print("ESCAPED", repr(out)[:300])
def sys_call(*args):  # a raw syscall; an error return becomes OSError like os.* calls
    ret = libc.syscall(*args)
    if ret < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return ret
"""
NR = {
    name: seccomp.syscall_number(name)
    for name in ("keyctl", "add_key", "request_key", "shmget", "ptrace", "unshare", "setns", "mount", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup")
}
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000


@dataclass(frozen=True)
class Hostile:
    name: str
    why: str  # what it would have done, uncontained
    code: str
    statuses: tuple[str, ...] = ("ok",)  # the run's allowed statuses
    expect: str = "BLOCKED"  # text the output must hold ("BLOCKED": the attack's call failed)
    needs_memory_cgroup: bool = False


def blocked(name: str, why: str, action: str) -> Hostile:
    """A probe whose one call must fail: `action` is an expression `attempt` calls."""
    return Hostile(name, why, f"attempt(lambda: {action})")


CORPUS = [
    # reading the host
    blocked("read /etc/shadow", "read the host's password hashes", "open('/etc/shadow').read()"),
    blocked("read /etc/passwd", "learn the host's users", "open('/etc/passwd').read()"),
    blocked("read the repository", "read the project's source and recipes", f"open({str(REPO / 'pyproject.toml')!r}).read()"),
    blocked("read the host canary", "read a file the host just wrote", "open(CANARY).read()"),
    blocked("read root's ssh keys", "steal credentials", "os.listdir('/root')"),
    blocked("read the host via /proc/1/root", "walk the host's root through its init", "open('/proc/1/root/etc/passwd').read()"),
    blocked("list the host's /tmp", "find other runs' files", "os.listdir('/tmp')"),
    blocked("read the project's venv", "read installed packages and their tokens", f"os.listdir({str(Path(sys.executable).parent)!r})"),
    blocked("open the raw disk", "read the host's block device", "open('/dev/vda', 'rb').read(512)"),
    blocked("read /sys", "read host hardware and cgroup state", "os.listdir('/sys/fs/cgroup')"),
    # writing outside scratch
    blocked("write into /usr", "plant a module every later run imports", "open('/usr/lib/python3/dist-packages/evil.py', 'w').write('x')"),
    blocked("write at the root", "leave a file for the next run", "open('/pwned', 'w').write('x')"),
    blocked("write into /dev", "fill /dev's unbounded tmpfs", "open('/dev/pwned', 'w').write('x')"),
    blocked("write the host canary", "change a host file", "open(CANARY, 'w').write('owned')"),
    blocked("symlink out of scratch", "reach /etc through a link", "(os.symlink('/etc', 'etc'), open('etc/shadow').read())"),
    blocked("mknod a disk", "create a device node for the host's disk", "os.mknod('disk', 0o600 | 0o60000, os.makedev(254, 0))"),
    blocked("chroot", "leave the root with the classic chroot escape", "os.chroot('/scratch')"),
    blocked("become root", "regain the privileges of uid 0", "os.setuid(0)"),
    blocked("mount a tmpfs", "mount a filesystem no limit applies to", "sys_call(NR['mount'], b'none', b'/scratch', b'tmpfs', 0, None)"),
    # keyrings and persistence across runs
    blocked("read the session keyring", "read the starting process's secrets (keyctl describe @s)", "sys_call(NR['keyctl'], 6, -3, None, 0)"),
    blocked("write the session keyring", "plant a key in the starting process's keyring", "sys_call(NR['add_key'], b'user', b'planted', b'x', 1, -3)"),
    blocked("write the user keyring", "persist data between runs in the uid's keyring", "sys_call(NR['add_key'], b'user', b'persist', b'x', 1, -4)"),
    blocked("join a named session keyring", "join a keyring another run created", "sys_call(NR['keyctl'], 1, b'shared')"),
    blocked("request_key upcall", "make the kernel run a helper on the host", "sys_call(NR['request_key'], b'user', b'x', b'callout', -3)"),
    blocked("read /proc/keys", "list every key the uid may view", "[l for l in open('/proc/keys') if l.strip()] or 1/0"),
    blocked("SysV shared memory", "hold memory no rlimit counts, beyond the run", "sys_call(NR['shmget'], 0, 64 << 20, 0o1000 | 0o600)"),
    blocked("memfd", "hold memory RLIMIT_AS does not count while unmapped", "os.memfd_create('x')"),
    # nested namespaces
    blocked("unshare a user namespace", "get full capabilities where the limits do not apply", "sys_call(NR['unshare'], CLONE_NEWUSER)"),
    blocked("unshare a mount namespace", "mount freely inside a new namespace", "sys_call(NR['unshare'], CLONE_NEWNS)"),
    blocked(
        "unshare(1) -Ur",
        "a 1 GB tmpfs with full capabilities in a child namespace",
        "subprocess.run(['unshare', '-Ur', 'sh', '-c', 'mount -t tmpfs none /scratch && echo MOUNTED'], capture_output=True, check=True)",
    ),
    blocked(
        "bwrap inside", "a sandbox of its own without the limits", "subprocess.run(['bwrap', '--bind', '/', '/', 'true'], capture_output=True, check=True)"
    ),
    blocked("setns into init's user ns", "join another namespace", "sys_call(NR['setns'], os.open('/proc/1/ns/user', os.O_RDONLY), 0)"),
    # introspection and kernel attack surface
    blocked("ptrace the init", "inject code into bwrap's init", "sys_call(NR['ptrace'], 16, 1, 0, 0)"),
    blocked("bpf", "load kernel programs", "sys_call(NR['bpf'], 0, None, 0)"),
    blocked("perf_event_open", "side channels through the PMU", "sys_call(NR['perf_event_open'], None, 0, -1, -1, 0)"),
    blocked("userfaultfd", "stall the kernel to win races", "sys_call(NR['userfaultfd'], 0)"),
    blocked("io_uring", "syscalls the filter cannot see", "sys_call(NR['io_uring_setup'], 8, ctypes.create_string_buffer(120))"),
    # the filter kills the process (SIGSYS, exit 159) on a foreign ABI rather than answer it
    Hostile("x32 ABI keyctl", "reach a denied call under another number", "sys_call(NR['keyctl'] | 0x40000000, 0, -3)\nprint('ESCAPED')", ("crashed",), "")
    if os.uname().machine == "x86_64"
    else None,
    # network
    blocked("connect to the host's loopback", "talk to a service on the host", "socket.create_connection(('127.0.0.1', PORT), timeout=1)"),
    blocked("connect out", "exfiltrate to the internet", "socket.create_connection(('1.1.1.1', 53), timeout=1)"),
    blocked("resolve a name", "exfiltrate through DNS", "socket.getaddrinfo('example.com', 80)"),
    blocked("raw socket", "forge packets", "socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)"),
    blocked("host's abstract unix socket", "talk to a host daemon on an abstract socket", "socket.socket(socket.AF_UNIX).connect(ABSTRACT)"),
    # signals to the host's processes
    blocked("signal the host's test process", "kill the trainer", "os.kill(HOST_PID, signal.SIGKILL)"),
    blocked("signal the host sleeper", "kill a host process of any uid", "os.kill(SLEEPER_PID, signal.SIGKILL)"),
    # inside its pid namespace only init is there to signal, and init ignores it: ESRCH
    Hostile("kill everything", "SIGKILL every process it may signal", "attempt(lambda: os.kill(-1, signal.SIGKILL))"),
    Hostile("kill the init", "take down the monitor before the limits apply", "os.kill(1, signal.SIGKILL)\nprint('INIT SURVIVED')", ("ok",), "INIT SURVIVED"),
    # information leaks
    Hostile("kernel command line", "read the host's boot parameters", "print('EMPTY' if open('/proc/cmdline').read() == '' else 'ESCAPED')", expect="EMPTY"),
    Hostile("kernel symbols", "defeat KASLR", "print('EMPTY' if open('/proc/kallsyms').read() == '' else 'ESCAPED')", expect="EMPTY"),
    Hostile(
        "host processes in /proc",
        "list and read the host's processes",
        "pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\nprint('OWN ONLY' if max(pids) < 10 else 'ESCAPED', pids)",
        expect="OWN ONLY",
    ),
    Hostile(
        "mount table",
        "learn the host's layout and the paths of other runs",
        "t = open('/proc/self/mountinfo').read()\nprint('ESCAPED' if any(p in t for p in ('/tmp', '/work', '/root', '/home', 'sandbox-')) else 'CLEAN')",
        expect="CLEAN",
    ),
    Hostile(
        "environment",
        "read the host's secrets from the environment",
        "print('ESCAPED' if SECRET in repr(os.environ) else 'CLEAN', sorted(os.environ))",
        expect="CLEAN",
    ),
    Hostile(
        "init's environment",
        "read the host's environment through bwrap's init",
        "print('ESCAPED' if SECRET.encode() in open('/proc/1/environ', 'rb').read() else 'CLEAN')",
        expect="CLEAN",
    ),
    Hostile("hostname", "identify the host", "print('ESCAPED' if socket.gethostname() == HOSTNAME else 'OWN UTS')", expect="OWN UTS"),
    Hostile("uid", "act as a user the host knows", "print('NOBODY' if os.getuid() == 65534 and os.getgid() == 65534 else 'ESCAPED')", expect="NOBODY"),
    Hostile(
        "capabilities",
        "hold capabilities",
        "print('NO CAPS' if 'CapEff:\\t0000000000000000' in open('/proc/self/status').read() else 'ESCAPED')",
        expect="NO CAPS",
    ),
    Hostile(
        "no_new_privs",
        "regain privileges through a setuid binary",
        "print('SET' if 'NoNewPrivs:\\t1' in open('/proc/self/status').read() else 'ESCAPED')",
        expect="SET",
    ),
    Hostile(
        "seccomp on", "run without the filter", "print('FILTERED' if 'Seccomp:\\t2' in open('/proc/self/status').read() else 'ESCAPED')", expect="FILTERED"
    ),
    # resource exhaustion
    Hostile("infinite loop", "hold a core for ever", "while True:\n    pass", ("cpu_limit", "timeout"), ""),
    Hostile("fork bomb", "exhaust the host's process table", "while True:\n    os.fork()", ("error", "timeout"), "Resource temporarily unavailable"),
    Hostile(
        "thread bomb",
        "exhaust the process table with threads",
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
        ("error", "timeout"),
        "can't start new thread",
    ),
    Hostile("memory bomb", "take the host's memory", "x = bytearray(2 << 30)", ("memory_limit",), "MemoryError"),
    Hostile("growing list", "take the host's memory slowly", "x = []\nwhile True:\n    x.append('a' * 10**6)", ("memory_limit",), ""),
    Hostile(
        "memory across processes",
        "pass the per-process limit with many processes",
        "import time\nfor _ in range(4):\n    if os.fork() == 0:\n        b = bytearray(200 << 20)\n        b[::4096] = b'1' * len(b[::4096])\n        time.sleep(1)\n        os._exit(0)\n"
        "print('EXITS', [os.wait()[1] for _ in range(4)])",
        ("memory_limit",),
        "",
        needs_memory_cgroup=True,
    ),
    Hostile("reserve a huge mapping", "overcommit the host", "import mmap\nattempt(lambda: mmap.mmap(-1, 8 << 30))", ("ok",)),
    Hostile(
        "zip bomb",
        "expand bytes to gigabytes",
        # zlib's fastest level: the bomb reaches the memory limit within its CPU second on a slow core too
        "import zlib\nz = zlib.compress(b'0' * (64 << 20), 1)\nx = [zlib.decompress(z) for _ in range(64)]",
        ("memory_limit",),
        "",
    ),
    Hostile("fill scratch", "fill the host's disk", "attempt(lambda: [open(f'f{i}', 'wb').write(b'0' * (3 << 20)) for i in range(16)])", ("ok",)),
    Hostile("one huge file", "write past the file-size limit", "open('big', 'wb').write(b'0' * (64 << 20))", ("crashed", "error"), ""),
    Hostile(
        "many small files", "exhaust scratch inodes", "attempt(lambda: [open(f'f{i}', 'w').close() for i in range(10**6)])", ("ok", "cpu_limit", "timeout"), ""
    ),
    Hostile("fill /dev/shm", "hold memory in shared memory files", "attempt(lambda: open('/dev/shm/x', 'wb').write(b'0' * (8 << 20)))", ("ok",)),
    Hostile("open every fd", "exhaust the host's file table", "attempt(lambda: [open('/dev/null') for _ in range(10**5)])", ("ok",)),
    Hostile("huge print", "flood the host's memory with output", "print('a' * 10**8)", ("output_limit", "memory_limit"), ""),
    Hostile("endless print", "flood the host with output", "while True:\n    print('spam' * 100)", ("output_limit",), ""),
    Hostile("close the pipes and linger", "outlive the run unseen", "import time\nos.close(1)\nos.close(2)\ntime.sleep(60)", ("timeout",), ""),
    Hostile("ignore SIGTERM", "survive a polite stop", "import time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)", ("timeout",), ""),
    Hostile(
        "detached daemon",
        "keep running after the run",
        "import time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')",
        ("ok",),
        "parent done",
    ),
    Hostile("catastrophic regex", "burn CPU with backtracking", "import re\nre.fullmatch('(a+)+b', 'a' * 64)", ("cpu_limit", "timeout"), ""),
    Hostile(
        "deep recursion",
        "overflow the C stack",
        "sys.setrecursionlimit(10**7)\nf = lambda n: f(n + 1)\nf(0)",
        ("crashed", "memory_limit", "cpu_limit", "error"),
        "",
    ),
    Hostile("ctypes segfault", "crash the interpreter", "ctypes.string_at(0)", ("crashed",), ""),
]
CORPUS = [c for c in CORPUS if c is not None]
# programs that are not valid UTF-8 / Python: each must come back as a result with a clear error
ENCODINGS = [
    ("lone surrogate", "print('\ud800')", ("error",), "SyntaxError"),
    ("lone surrogate in a comment", "# \udcff\nprint(1)", ("error",), "SyntaxError"),
    ("invalid UTF-8", b"print('\xff\xfe')", ("error",), "SyntaxError"),
    ("NUL byte", b"print(1)\x00print(2)", ("ok", "error"), ""),
    ("only NUL bytes", b"\x00" * 100, ("ok", "error"), ""),
    ("empty program", "", ("ok",), ""),
    ("one megabyte of comments", "#" * (1 << 20) + "\nprint('END')", ("ok",), "END"),
]
