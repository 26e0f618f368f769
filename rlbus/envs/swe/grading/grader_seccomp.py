"""A seccomp filter that keeps the report channel the runner's: no process of the test run can replace it.

The test process (`rlbus.envs.swe.grading.grader_runner`) installs this before any repository code exists; the
kernel applies it to that process, every thread, and every process it starts — for good: a filter cannot
be removed, and ``PR_SET_NO_NEW_PRIVS`` (which unprivileged filters need, and bubblewrap already sets)
cannot be cleared. Denied with ``EPERM`` (the call fails, the process goes on):

    =======================================  ====================================================
    system call                              why
    =======================================  ====================================================
    ``close(ch)``, ``close_range`` over ch   the number would be free for a pipe of the candidate's
    ``dup2(x, ch)``, ``dup3(x, ch)``         the channel pointed at the candidate's pipe (to read
                                             the token a record carries, then forge records)
    ``fcntl(ch, F_DUPFD[_CLOEXEC])``         a second handle on the channel
    ``prctl(PR_SET_DUMPABLE)``               the runner's memory (the token) readable again
    ``ptrace``, ``process_vm_readv/writev``  another process's memory
    ``pidfd_getfd``                          another process's descriptors
    ``io_uring_*``                           descriptor operations the filter would not see
    x32 system calls, other architectures    the same calls under other numbers
    =======================================  ====================================================

``ch`` is the channel's descriptor number. The filter is classic BPF built here (about forty
instructions) and installed with ``prctl(PR_SET_SECCOMP)`` through ctypes: no library to install, on any
Linux of the last decade; the Debian package ``python3-seccomp`` (libseccomp) would do the same with a
dependency CI images do not all have. Layout of ``struct seccomp_data`` and the return values: the
kernel's ``Documentation/userspace-api/seccomp_filter.rst``.
"""

import struct
from typing import Any

#: audit architecture → system call numbers (``None``: the call does not exist there).
SYSCALLS: dict[int, dict[str, Any]] = {
    0xC000003E: {  # x86_64
        "close": 3, "dup2": 33, "dup3": 292, "fcntl": 72, "close_range": 436, "prctl": 157, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427,
    },
    0xC00000B7: {  # aarch64
        "close": 57, "dup2": None, "dup3": 24, "fcntl": 25, "close_range": 436, "prctl": 167, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427,
    },
}  # fmt: skip
_MACHINES = {"x86_64": 0xC000003E, "amd64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}
_LD_W_ABS, _JEQ, _JGE, _JGT, _JA, _RET = 0x20, 0x15, 0x35, 0x25, 0x05, 0x06
_ALLOW, _ERRNO, _EPERM = 0x7FFF0000, 0x00050000, 1
_NR, _ARCH = 0, 4
_X32 = 0x40000000
_F_DUPFD, _F_DUPFD_CLOEXEC, _PR_SET_DUMPABLE = 0, 1030, 4
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _arg(i: int) -> int:
    """Offset of the low 32 bits of argument ``i`` (little-endian; every argument checked is 32-bit)."""
    return 16 + 8 * i


class _Program:
    """Classic BPF with symbolic jump targets, resolved by `assemble`."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, k: int, true: object = 0, false: object = 0) -> None:
        self.code.append((op, true, false, k))

    def ret(self, value: int) -> None:
        self.code.append((_RET, 0, 0, value))

    def assemble(self) -> bytes:
        out = b""
        for at, (op, jt, jf, k) in enumerate(self.code):
            out += struct.pack("=HBBI", op, self._offset(jt, at), self._offset(jf, at), k)
        return out

    def _offset(self, target: object, at: int) -> int:
        if isinstance(target, int):
            return target
        distance = self.labels[str(target)] - at - 1
        if not 0 <= distance < 256:
            raise ValueError(f"jump to {target} out of range")
        return distance


def program(channel: int, arch: int) -> bytes:
    """The filter for the channel's descriptor ``channel`` on audit architecture ``arch``."""
    nr = SYSCALLS[arch]
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ, arch, 0, "deny")
    p.load(_NR)
    if arch == 0xC000003E:
        p.jump(_JGE, _X32, "deny", 0)
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "io_uring_setup",
                 "io_uring_enter", "io_uring_register"):  # fmt: skip
        p.jump(_JEQ, nr[name], "deny", 0)
    p.jump(_JEQ, nr["close"], "arg0", 0)
    if nr["dup2"] is not None:
        p.jump(_JEQ, nr["dup2"], "arg1", 0)
    p.jump(_JEQ, nr["dup3"], "arg1", 0)
    p.jump(_JEQ, nr["close_range"], "range", 0)
    p.jump(_JEQ, nr["fcntl"], "fcntl", 0)
    p.jump(_JEQ, nr["prctl"], "prctl", 0)
    p.ret(_ALLOW)
    p.label("arg0")  # close(channel)
    p.load(_arg(0))
    p.jump(_JEQ, channel, "deny", "allow")
    p.label("arg1")  # dup2 / dup3 onto the channel
    p.load(_arg(1))
    p.jump(_JEQ, channel, "deny", "allow")
    p.label("range")  # close_range(first, last, flags) with first <= channel <= last
    p.load(_arg(0))
    p.jump(_JGT, channel, "allow", 0)
    p.load(_arg(1))
    p.jump(_JGE, channel, "deny", "allow")
    p.label("fcntl")  # fcntl(channel, F_DUPFD | F_DUPFD_CLOEXEC, …)
    p.load(_arg(0))
    p.jump(_JEQ, channel, 0, "allow")
    p.load(_arg(1))
    p.jump(_JEQ, _F_DUPFD, "deny", 0)
    p.jump(_JEQ, _F_DUPFD_CLOEXEC, "deny", "allow")
    p.label("prctl")
    p.load(_arg(0))
    p.jump(_JEQ, _PR_SET_DUMPABLE, "deny", "allow")
    p.label("allow")
    p.ret(_ALLOW)
    p.label("deny")
    p.ret(_ERRNO | _EPERM)
    return p.assemble()


def architecture() -> int:
    """This machine's audit architecture; OSError where the filter has no numbers for it."""
    import os

    machine = os.uname().machine
    if machine not in _MACHINES:
        raise OSError(f"no seccomp filter for the {machine} architecture")
    return _MACHINES[machine]


def not_dumpable() -> None:
    """Keep processes of the same uid (children included) out of this one's memory and descriptors: with
    ``PR_SET_DUMPABLE`` 0, ``/proc/PID/mem``, ``/proc/PID/fd`` and ``ptrace`` need privileges no sandboxed
    process has."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)
    if libc.prctl(_PR_SET_DUMPABLE, zero, zero, zero, zero) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def install(channel: int) -> None:
    """Guard ``channel`` in this process and every process it starts (see the module docstring)."""
    import ctypes

    code = program(channel, architecture())
    libc = ctypes.CDLL(None, use_errno=True)

    class Filter(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Filter(len(code) // 8, code)
    zero, ulong = ctypes.c_ulong(0), ctypes.c_ulong
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, ulong(1), zero, zero, zero) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog), zero, zero) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
