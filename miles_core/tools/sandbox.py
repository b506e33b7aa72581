"""Runs model-written Python in a contained, short-lived process.

Containment, layer by layer (docs/security.md has the threat model; tests/hostile/ the corpus):

* a **launcher** (a few lines of the system Python, exec'd, not a preexec_fn, which is unsafe in
  a process with threads) puts itself in this run's **cgroup** (tools/cgroup.py: the whole
  sandbox's memory, tmpfs, shm and memfd included, and its process count), sets the **rlimits**
  every process inherits (RLIMIT_CPU seconds per process, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE,
  RLIMIT_NOFILE, RLIMIT_CORE = 0), switches (when run as root) to a **uid of its own** taken from a
  pool of slots held by file locks, so RLIMIT_NPROC counts this sandbox's processes only and no
  two concurrent sandboxes can signal each other, sets no_new_privs, joins a **new anonymous
  session keyring** and execs bubblewrap.
* **bubblewrap** (`bwrap` >= 0.8, Debian package `bubblewrap`) unshares the user (uid 65534
  inside, **nested user namespaces disabled**), pid, network (only its own loopback), ipc (SysV
  objects die with the run), uts and cgroup namespaces; the root holds a read-only `/usr` (the
  system Python and its standard library), `/proc` of the sandbox's own pid namespace with the
  host's kernel command line, keys, symbols and timers masked by empty files, a read-only `/dev`
  with a small `/dev/shm`, the code (copied in through a file descriptor: no host path shows in
  the mount table) and a size-limited scratch tmpfs as the working directory. Nothing else of
  the host exists inside. When the sandbox's init dies the kernel kills every process left in
  its pid namespace, daemons included.
* a **seccomp** filter (tools/seccomp.py) denies keyrings, memfd and SysV shm, namespaces, mounts,
  ptrace, bpf, perf and io_uring.
* the host side holds a **wall-clock** deadline and an **output** cap (stdout + stderr); past
  either, the whole process group is SIGKILLed (`--die-with-parent` then takes down the
  namespace), and the cgroup's remaining members are killed. Cleanup runs on every path.

Needs: bwrap with unprivileged user namespaces (run_python raises `SandboxUnavailable` naming what
is missing). Without a writable memory cgroup the total memory is capped by RLIMIT_AS per process
plus the seccomp filter (no memfd, no SysV shm) and the tmpfs sizes; without root or a pids
cgroup, RLIMIT_NPROC counts all processes of the invoking user.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

from miles_core.tools import cgroup, seccomp
from miles_core.tools.cgroup import SandboxCgroup
from miles_core.tools.runs import CPU_LIMIT, CRASHED, ERROR, MEMORY_LIMIT, OK, OUTPUT_LIMIT, TIMEOUT, SandboxLimits, SandboxResult

NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """The machine lacks what the sandbox needs (bwrap, a system Python); the message says what."""


# Runs as `python3 -I -S -c _LAUNCHER SPEC BWRAP ARGS...`: the steps that must happen in the
# sandbox's first process, before bwrap, in an order that keeps each one possible. It stays as the
# child subreaper of everything below it: bwrap's monitor exits without reaping its pid-1 init,
# which would otherwise linger as a zombie of the host's init, counted against the uid's processes.
# SIGTERM (the host's deadline) kills bwrap, whose namespace dies with it; the launcher reaps all.
_LAUNCHER = """import ctypes, json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.exit(f"sandbox launcher: cannot {what}: {os.strerror(ctypes.get_errno())}")
for path in spec["cgroup_procs"]:  # before dropping root: only the owner may move a process
    with open(path, "w") as f:
        f.write(str(os.getpid()))
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if spec["uid"] is not None:
    os.setgroups([])
    os.setresgid(spec["uid"], spec["uid"], spec["uid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
check(libc.prctl(38, 1, 0, 0, 0) == 0, "set no_new_privs")  # PR_SET_NO_NEW_PRIVS
check(libc.syscall(spec["keyctl"], 1, None) >= 0, "join a new session keyring")  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
check(libc.prctl(36, 1, 0, 0, 0) == 0, "become a child subreaper")  # PR_SET_CHILD_SUBREAPER
bwrap = os.fork()
if bwrap == 0:
    os.execv(sys.argv[2], sys.argv[2:])
signal.signal(signal.SIGTERM, lambda *_: os.kill(bwrap, signal.SIGKILL))
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == bwrap:
        code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""
UID_BASE, UID_SLOTS = 0x5A000000, 4096  # one uid per concurrent sandbox, far above any real user
SLOT_LOCKS = os.path.join("/run/lock" if os.path.isdir("/run/lock") else "/tmp", "miles-sandbox-uids")  # a lock per uid slot: the machine's, whatever TMPDIR
SHM_BYTES = 1 << 20  # /dev/shm (POSIX semaphores of multiprocessing need a few bytes)
BWRAP_PROCESSES = 3  # the launcher, bwrap's monitor and its pid-1 init, besides the code's processes
# host information in /proc that a pid namespace does not hide: kernel command line, config and
# symbols, keys of every keyring the caller may view, loaded modules, scheduler and timer state
MASKED_PROC = ("cmdline", "config.gz", "kallsyms", "keys", "key-users", "modules", "sched_debug", "timer_list", "kmsg", "iomem", "ioports")


@contextlib.contextmanager
def _own_uid():
    """A uid no other running sandbox holds (a file lock per slot), or None when not root."""
    if os.geteuid() != 0:
        yield None
        return
    os.makedirs(SLOT_LOCKS, mode=0o700, exist_ok=True)
    first = secrets.randbelow(UID_SLOTS)  # spreads reuse: a slot's previous processes have long died
    for slot in ((first + i) % UID_SLOTS for i in range(UID_SLOTS)):
        with open(os.path.join(SLOT_LOCKS, str(slot)), "ab") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield UID_BASE + slot
            return
    raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids are in use")


def _empty_fd() -> int:
    """The read end of a pipe with nothing in it: `--ro-bind-data` turns it into an empty file."""
    read, write = os.pipe()
    os.close(write)
    return read


def _bwrap_args(limits: SandboxLimits, code_fd: int, seccomp_fd: int, masks: dict[str, int]) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap is not installed (no `bwrap` on PATH): `apt-get install bubblewrap` (make setup does)")
    masked = [arg for name, fd in masks.items() for arg in ("--ro-bind-data", str(fd), f"/proc/{name}")]
    return [
        bwrap,
        "--unshare-user",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        "--disable-userns",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
        "sandbox",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--symlink",
        "usr/bin",
        "/bin",
        "--proc",
        "/proc",
        *masked,
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(SHM_BYTES),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(limits.scratch_mb << 20),
        "--tmpfs",
        "/scratch",
        "--perms",
        "0755",
        "--dir",
        "/code",
        "--perms",
        "0444",
        "--file",
        str(code_fd),
        "/code/main.py",
        "--remount-ro",
        "/",
        "--chdir",
        "/scratch",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin",
        "--setenv",
        "HOME",
        "/scratch",
        "--setenv",
        "TMPDIR",
        "/scratch",
        "--setenv",
        "PYTHONIOENCODING",
        "utf-8:backslashreplace",
        "--seccomp",
        str(seccomp_fd),
        limits.python,
        "-I",
        "-B",
        "/code/main.py",
    ]


def _own_processes() -> int:
    uid = os.getuid()
    return sum(1 for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid)


def _uid_of(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _launch_spec(limits: SandboxLimits, uid: int | None, group: SandboxCgroup) -> str:
    # with a uid of its own or a pids cgroup, RLIMIT_NPROC / pids.max count this sandbox only;
    # otherwise RLIMIT_NPROC counts the invoking user's processes, so it is raised by their count
    shared_user = uid is None and "pids" not in group.controllers
    nproc = limits.max_processes + BWRAP_PROCESSES + (_own_processes() if shared_user else 0)
    rlimits = {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_mb << 20,
        "RLIMIT_NPROC": nproc,
        "RLIMIT_FSIZE": limits.max_file_mb << 20,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_CORE": 0,
    }
    return json.dumps({"cgroup_procs": group.procs_files, "rlimits": rlimits, "uid": uid, "keyctl": seccomp.syscall_number("keyctl")})


def _check_python(limits: SandboxLimits) -> None:
    if not os.path.isfile(limits.python) or not limits.python.startswith("/usr/"):
        raise SandboxUnavailable(f"sandbox python {limits.python!r} is not a file under /usr (the only tree mounted inside)")


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
    """Stop the launcher's bwrap (the pid namespace goes with it) and let the launcher reap it all;
    SIGKILL the whole process group if the launcher does not exit promptly."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _status(exit_code: int, stderr: str, killed: str | None, oom_killed: bool) -> str:
    if killed:
        return killed
    if oom_killed or "MemoryError" in stderr:
        return MEMORY_LIMIT
    if exit_code == 0:
        return OK
    if exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):  # the kernel's RLIMIT_CPU signals
        return CPU_LIMIT
    return CRASHED if exit_code > 128 else ERROR


def _source_bytes(code: str | bytes) -> bytes:
    """The program's bytes: any str (lone surrogates kept, so Python reports them) or bytes."""
    if isinstance(code, (bytes, bytearray)):
        return bytes(code)
    if isinstance(code, str):
        return code.encode("utf-8", "surrogatepass")
    raise TypeError(f"run_python: code must be str or bytes, got {type(code).__name__}")


def run_python(code: str | bytes, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` (Python source, any str or bytes) in a fresh sandbox; never raises for anything the code does."""
    started = time.monotonic()
    source = _source_bytes(code)
    _check_python(limits)
    filter_bytes = seccomp.deny_filter()
    memory = ((limits.memory_mb + limits.scratch_mb) << 20) + SHM_BYTES  # the processes, the scratch tmpfs and /dev/shm
    with tempfile.TemporaryFile() as code_file, tempfile.TemporaryFile() as filter_file, _own_uid() as uid:
        for file, data in ((code_file, source), (filter_file, filter_bytes)):
            file.write(data)
            file.seek(0)
        masks = {name: _empty_fd() for name in MASKED_PROC if os.path.exists(f"/proc/{name}")}
        group = cgroup.create(memory, limits.max_processes + BWRAP_PROCESSES)
        try:
            sandbox = _bwrap_args(limits, code_file.fileno(), filter_file.fileno(), masks)
            cmd = [limits.python, "-I", "-S", "-c", _LAUNCHER, _launch_spec(limits, uid, group), *sandbox]
            # env: no host variable reaches the launcher, so none shows in bwrap's init's /proc/1/environ either
            proc = subprocess.Popen(
                cmd,
                env={"PATH": "/usr/bin"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(code_file.fileno(), filter_file.fileno(), *masks.values()),
            )
            try:
                out, err, killed = _collect(proc, limits, started)
            finally:
                _kill(proc)
                proc.stdout.close()
                proc.stderr.close()
            oom_killed = group.oom_killed()
        finally:
            group.close()
            for fd in masks.values():
                os.close(fd)
    cap = limits.max_output_bytes
    stdout, stderr = out[:cap].decode("utf-8", "replace"), err[:cap].decode("utf-8", "replace")
    exit_code = -signal.SIGKILL if killed else proc.returncode
    return SandboxResult(_status(exit_code, stderr, killed, oom_killed), exit_code, stdout, stderr, time.monotonic() - started)
