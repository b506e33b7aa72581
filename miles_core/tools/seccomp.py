"""The sandbox's seccomp filter: a classic-BPF program for `bwrap --seccomp FD`.

bubblewrap loads a compiled filter but cannot build one; libseccomp is not a dependency, so the
program is assembled here (it is a short list of comparisons). Every syscall listed below fails
with EPERM, all others are allowed; a foreign ABI (x32 on x86_64, or any architecture the filter
was not built for) kills the process, so a denied call cannot be reached under another number.

What is denied, and why (most of it is also what Docker's default profile denies):
* keyrings (`keyctl`, `add_key`, `request_key`): the session keyring of the process that started
  the sandbox, and the user keyring that outlives a run, are otherwise readable and writable.
* `memfd_create`, `memfd_secret`, `shmget`: memory that RLIMIT_AS does not count while unmapped
  (the cgroup counts it where there is one; without one, this is what caps it).
* namespaces and mounts (`unshare`, `setns`, `mount`, the new mount API, `pivot_root`): no
  nested sandbox in which the scratch and memory limits would not apply (`--disable-userns`
  closes the user-namespace path; this closes the rest).
* introspection and kernel attack surface: `ptrace`, `process_vm_*`, `kcmp`, `bpf`,
  `perf_event_open`, `userfaultfd`, `io_uring_*`, `*_by_handle_at`.
"""

from __future__ import annotations

import platform
import struct

DENIED = (
    "keyctl",
    "add_key",
    "request_key",
    "memfd_create",
    "memfd_secret",
    "shmget",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
)
# machine: (AUDIT_ARCH, the numbers of DENIED in order), from the kernel's syscall tables
_NUMBERS = {
    "x86_64": (
        0xC000003E,
        (250, 248, 249, 319, 447, 29, 101, 310, 311, 312, 321, 298, 323, 425, 426, 427, 272, 308, 165, 166, 155, 428, 429, 430, 431, 432, 433, 442, 303, 304),
    ),
    "aarch64": (
        0xC00000B7,
        (219, 217, 218, 279, 447, 194, 117, 270, 271, 272, 280, 241, 282, 425, 426, 427, 97, 268, 40, 39, 41, 428, 429, 430, 431, 432, 433, 442, 264, 265),
    ),
}
X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under numbers with this bit set

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO, _EPERM = 0x7FFF0000, 0x80000000, 0x00050000, 1
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


class SeccompUnsupported(RuntimeError):
    """No syscall table for this machine's architecture."""


def syscall_number(name: str, machine: str | None = None) -> int:
    """The number of a syscall the filter knows, on this (or the named) machine."""
    _, numbers = _table(machine)
    return numbers[DENIED.index(name)]


def _table(machine: str | None) -> tuple[int, tuple[int, ...]]:
    machine = machine or platform.machine()
    if machine not in _NUMBERS:
        raise SeccompUnsupported(f"the sandbox's seccomp filter has no syscall table for {machine!r} (known: {', '.join(_NUMBERS)})")
    return _NUMBERS[machine]


def deny_filter(machine: str | None = None) -> bytes:
    """The compiled filter (struct sock_filter[]: u16 code, u8 jt, u8 jf, u32 k)."""
    arch, numbers = _table(machine)
    program = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _RET_KILL_PROCESS), (_LD_W_ABS, 0, 0, _NR)]
    if arch == _NUMBERS["x86_64"][0]:
        program += [(_JGE_K, 0, 1, X32_BIT), (_RET_K, 0, 0, _RET_KILL_PROCESS)]
    deny_at = len(program) + len(numbers) + 1  # the index of the final "return EPERM"
    program += [(_JEQ_K, deny_at - (len(program) + i) - 1, 0, nr) for i, nr in enumerate(numbers)]
    program += [(_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)
