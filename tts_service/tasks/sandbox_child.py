"""The child side of the code sandbox: confines itself, then runs one untrusted program.

Started by `sandbox.py` as `python -I -B sandbox_child.py SPEC` in a fresh temporary directory
(the box, its cwd), inside new network, IPC and mount namespaces where the platform allows
(plus a user namespace when the evaluator is not root). Before the program runs it applies
every layer the platform allows:

1. rlimits: address space (memory), CPU seconds (SIGXCPU, then SIGKILL a second later), file
   size (which also caps stdout, a file), open files, no core dumps, and tasks (RLIMIT_NPROC,
   only where the kernel enforces it: a non-root user in its own user namespace, where the
   count covers the sandbox alone).
2. The box becomes a tmpfs of `box_mb` MiB, so everything the program stores, open or
   unlinked, counts against one cap; with memfd and SysV shared memory refused (5.), memory
   outside the address space is bounded by that cap and by open files (pipe and socket
   buffers).
3. Landlock (Linux >= 5.13): reads only beneath the interpreter's library directories,
   site-packages, the shared-library directories and the box (never this package, whose
   fixtures hold expected outputs), writes only in the box (plus /dev/null), no execve and no
   mounts; from ABI 4 TCP bind/connect are refused; from ABI 6 signals and abstract UNIX
   sockets cannot reach processes outside the sandbox.
4. Privileges: when the evaluator is root the child drops to uid/gid `drop_uid` (nobody) with
   no supplementary groups, after covering any directory on the interpreter's path that uid
   cannot search (a Python under /root, mode 0700) with a tmpfs that holds only bind mounts of
   what it needs. Either way it then empties its capability sets (root in a user namespace
   keeps none). If the box or the uid change the parent asked for fails, nothing runs.
5. seccomp (x86-64, aarch64): no new processes (fork, vfork, clone without CLONE_THREAD), no
   execve, no unshare (no way back to capabilities or to a fresh, uncapped tmpfs), no
   memfd_create, memfd_secret, shmget, msgget or mq_open (memory outside the address space),
   and no io_uring (operations run by kernel workers, beside the filter);
   threads still work. clone3 answers ENOSYS so that libc falls back to clone, whose flags a
   filter can read.
6. An audit hook (PEP 578): the same rules at the Python level, refused with a message that
   names the operation; it is also the only layer where the kernel offers none of the above.
   It runs in the program's own process, which can switch it off: only the kernel layers are a
   boundary.

Nothing this process reports is trusted: the parent computes the verdict from the exit status
and stdout. The child exits 0 when the program finished; otherwise it writes one marker line
to stderr, `sandbox: <memory|refused|error> <name>` (an exception or audit event name), and
exits 1, so the parent can say why. A functional test's returned value is printed as the last
line of stdout. Stdlib only: it runs before the program, in a bare interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import resource
import stat
import struct
import sys
import sysconfig
import threading
import traceback
from pathlib import PurePath
from typing import NoReturn

# LiveCodeBench's harness runs solutions after imports like these; LeetCode-style code relies
# on them (`List[int]` without `from typing import List`, `gcd` without `from math import`).
PRELUDE = (
    "import sys, os, math, heapq, bisect, itertools, functools, collections, string, re\n"
    "import random, copy, operator\n"
    "from typing import *\nfrom collections import *\nfrom itertools import *\n"
    "from functools import *\nfrom heapq import *\nfrom bisect import *\nfrom math import *\n"
    "from builtins import *\n"  # math.pow and friends must not shadow the builtins
)

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_PR_CAPBSET_DROP, _CAP_VERSION_3 = 24, 0x20080522
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # same on every arch
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_MOVE, _MS_REC = 2, 4, 8, 4096, 8192, 16384
# What a Python program reads besides its own files: the shared libraries extension modules
# load (libcrypto, libffi, ...) and the loader's cache.
_LIB_PATHS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _limit(kind: int, value: int) -> bool:
    """Lower a limit (never above the inherited hard limit, which only privilege could raise);
    False where the platform refuses it. CPU time: SIGXCPU at the soft limit, and the kernel's
    SIGKILL one second later (the hard limit) for a program that ignores the signal."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    ceiling = value
    if kind == resource.RLIMIT_CPU:
        ceiling = value + 1 if hard == resource.RLIM_INFINITY else min(value + 1, hard)
    try:
        resource.setrlimit(kind, (value, ceiling))
    except (ValueError, OSError):
        return False
    return True


def set_limits(spec: dict) -> list[str]:
    """Apply the limits; returns the names of those that took."""
    mib = 1 << 20
    wanted = {
        "as": (resource.RLIMIT_AS, spec["memory_mb"] * mib),
        "cpu": (resource.RLIMIT_CPU, spec["cpu_s"]),  # SIGXCPU at the soft limit
        "fsize": (resource.RLIMIT_FSIZE, spec["max_output_mb"] * mib),
        "nofile": (resource.RLIMIT_NOFILE, 256),
        "core": (resource.RLIMIT_CORE, 0),
    }
    if spec["max_tasks"]:
        wanted["nproc"] = (resource.RLIMIT_NPROC, spec["max_tasks"])
    return [name for name, (kind, value) in wanted.items() if _limit(kind, value)]


def _mount(target: str, flags: int, source: str = "tmpfs", options: str = "") -> None:
    """mount(2): a tmpfs with `options`, or with MS_BIND / MS_MOVE the tree at `source`."""
    fstype = None if flags & (_MS_BIND | _MS_MOVE) else b"tmpfs"
    data = options.encode() if options else None
    if _LIBC.mount(source.encode(), target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def box_tmpfs(root: str, size_mb: int, uid: int | None) -> None:
    """Mount a tmpfs of `size_mb` MiB over the box (owned by `uid` when the child drops to it),
    so that what the program stores, open or unlinked, counts against one cap."""
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    options = f"size={size_mb}m,nr_inodes=4096,mode=0700{owner}"
    _mount(root, _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options=options)
    os.chdir(root)  # onto the new mount


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _without(root: str, excluded: str) -> list[str]:
    """`root`'s tree less `excluded`, as the fewest whole subtrees."""
    if not _within(excluded, root):
        return [root]
    if root == excluded:
        return []
    return [path for entry in os.scandir(root) for path in _without(entry.path, excluded)]


def read_roots() -> list[str]:
    """What a Python program reads besides its box: the interpreter's library directories,
    site-packages and the shared libraries, less this package (an installed copy would sit in
    site-packages, and its fixtures hold expected outputs)."""
    paths = sysconfig.get_paths()
    python = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    found = {os.path.realpath(p) for p in (*python, *_LIB_PATHS) if os.path.exists(p)}
    top = [p for p in found if not any(q != p and _within(p, q) for q in found)]
    return sorted(r for p in top for r in _without(p, _PACKAGE))


def _searchable(directory: str, uid: int) -> bool:
    st = os.stat(directory)
    return bool(st.st_mode & 0o001 or (st.st_uid == uid and st.st_mode & 0o100))


def expose(paths: list[str], uid: int, staging: str) -> None:
    """Let `uid` reach `paths`: a directory on the way that it cannot search (a Python under
    /root, mode 0700) is covered by a tmpfs holding only bind mounts of the paths beneath it,
    built in `staging` and then moved into place (the rest of that directory stays hidden)."""
    covers: dict[str, list[str]] = {}
    for path in paths:
        parents = [str(d) for d in reversed(PurePath(path).parents)]  # "/" first
        blocked = next((d for d in parents if not _searchable(d, uid)), None)
        if blocked is not None:
            covers.setdefault(blocked, []).append(path)
    for i, (cover, inner) in enumerate(covers.items()):
        stage = os.path.join(staging, f".cover{i}")
        os.mkdir(stage)
        _mount(stage, _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options="size=1m,mode=0755")
        for path in inner:
            target = stage + path[len(cover.rstrip(os.sep)) :]
            if os.path.isdir(path):
                os.makedirs(target, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
                open(target, "x").close()
            _mount(target, _MS_BIND | _MS_REC, source=path)
        _mount(cover, _MS_MOVE, source=stage)
        os.rmdir(stage)


def drop_privileges(uid: int | None) -> bool:
    """Become `uid` (its gid too, no supplementary groups) when given, then empty the
    capability sets; True when none is left. The bounding set is emptied too while uid 0
    still holds CAP_SETPCAP; after a change to another uid, execve (refused anyway) could not
    regain any capability."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    for cap in range(64):  # EINVAL past the last capability, EPERM without CAP_SETPCAP
        _LIBC.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    return _LIBC.capset(header, (ctypes.c_uint32 * 6)()) == 0


# Landlock access rights (linux/landlock.h)
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_WRITES = 1 << 1 | 1 << 4 | 1 << 5 | 1 << 6 | 1 << 7 | 1 << 8 | 1 << 9 | 1 << 10 | 1 << 11
_FS_WRITES |= 1 << 12  # write, remove dir/file, make char/dir/reg/sock/fifo/block/symlink
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE  # on a non-directory
_NET_TCP = 1 << 0 | 1 << 1  # bind, connect
_SCOPES = 1 << 0 | 1 << 1  # abstract UNIX sockets, signals


def landlock(root: str, reads: list[str]) -> int:
    """Reads only beneath `root` and `reads`, writes only beneath `root` (and to /dev/null), no
    execve; returns the ABI applied, 0 if none."""
    if sys.platform != "linux":  # syscall numbers below are Linux's
        return 0
    abi = _LIBC.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    fs = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR | _FS_WRITES
    fs |= (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    attr = (ctypes.c_uint64 * 3)(fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = ctypes.c_size_t(ctypes.sizeof(attr))  # zeroed fields are fine for older ABIs
    ruleset = _LIBC.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), size, ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    rules = [(root, fs & ~_FS_EXECUTE), (os.devnull, fs)]
    rules += [(path, _FS_READ_FILE | _FS_READ_DIR) for path in reads]
    if stat.S_ISREG(os.fstat(0).st_mode):  # open("/dev/stdin") reaches the stdin file by name
        rules.append(("/proc/self/fd/0", _FS_READ_FILE))
    try:
        for path, rights in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                rights &= _FILE_RIGHTS & ~_FS_EXECUTE
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd))  # packed struct
            added = _LIBC.syscall(_SYS_ADD_RULE, ruleset, 1, rule, ctypes.c_uint32(0))
            os.close(fd)
            if added != 0:
                return 0
        _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0)
        return abi if _LIBC.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) == 0 else 0
    finally:
        os.close(ruleset)


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


# io_uring runs file and socket operations in kernel workers, outside the rules a system call
# is checked by; nothing a test program needs (same numbers on every architecture)
_IO_URING = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}
# audit arch, syscall numbers; x86-64 also has the x32 ABI (numbers with bit 30 set) to refuse
_ARCHES = {
    "x86_64": (
        0xC000003E,
        {"clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "unshare": 272}
        | {"memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "mq_open": 240}
        | _IO_URING,
    ),
    "aarch64": (
        0xC00000B7,
        {"clone": 220, "execve": 221, "execveat": 281, "unshare": 97}
        | {"memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "mq_open": 180}
        | _IO_URING,
    ),
}
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050000, 1, 38
_CLONE_THREAD, _CLONE3 = 0x00010000, 435


def seccomp() -> list[str]:
    """Refuse (EPERM) new processes, execve, unshare, memory that lives outside the address
    space (memfd, SysV shared memory and message queues, POSIX message queues) and io_uring;
    returns the system calls refused outright, empty if no filter was installed."""
    if sys.platform != "linux" or platform.machine() not in _ARCHES:
        return []
    arch, nr = _ARCHES[platform.machine()]
    denied = sorted(name for name in nr if name != "clone")
    deny = (_RET, 0, 0, _ERRNO | _EPERM)
    prog = [(_LD, 0, 0, 4), (_JEQ, 1, 0, arch), deny, (_LD, 0, 0, 0)]  # foreign ABI: refuse
    if "fork" in nr:
        prog += [(_JGE, 0, 1, 0x40000000), deny]
    prog += [(_JEQ, 0, 1, _CLONE3), (_RET, 0, 0, _ERRNO | _ENOSYS)]
    for name in denied:
        prog += [(_JEQ, 0, 1, nr[name]), deny]
    # clone: allowed only for threads; args[0] (flags) low word sits at offset 16
    prog += [(_JEQ, 0, 2, nr["clone"]), (_LD, 0, 0, 16), (_JSET, 0, 1, _CLONE_THREAD)]
    prog += [(_RET, 0, 0, _ALLOW), deny]
    filters = (_SockFilter * len(prog))(*(_SockFilter(c, t, f, k) for c, t, f, k in prog))
    fprog = _SockFprog(len(prog), filters)
    _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0)
    mode = ctypes.c_ulong(_SECCOMP_MODE_FILTER)
    installed = _LIBC.prctl(_PR_SET_SECCOMP, mode, ctypes.byref(fprog), 0, 0) == 0
    return denied if installed else []


_SPAWN_PREFIXES = ("os.fork", "os.exec", "os.spawn", "os.posix_spawn", "os.system", "pty.")
_NET_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
_PATH_EVENTS = frozenset(
    (
        "os.mkdir",
        "os.rmdir",
        "os.remove",
        "os.rename",
        "os.truncate",
        "os.chmod",
        "os.chown",
        "os.link",
        "os.symlink",
        "os.utime",
        "os.setxattr",
        "os.removexattr",
        "os.mkfifo",
        "os.mknod",
        "shutil.rmtree",
        "shutil.chown",
    )
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _outside(root: str, path: object) -> bool:
    if isinstance(path, int) or not isinstance(path, str | bytes | os.PathLike):
        return False
    full = os.path.realpath(os.fsdecode(path))
    return full != root and not full.startswith(root + os.sep) and full != os.devnull


def audit_hook(root: str, refusals: list[str]):
    """Refuse, with a message, what the program must not do: write outside `root`, open
    network connections, start processes or signal others, or call C through ctypes. Each
    refused event's name goes to `refusals`."""

    def hook(event: str, args: tuple) -> None:
        reason = None
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & _WRITE_FLAGS)
            if writing and _outside(root, path):
                reason = f"write to {os.fsdecode(path)}"
        elif event in _PATH_EVENTS and any(_outside(root, a) for a in args):
            reason = f"{event} outside the sandbox"
        elif event in _NET_EVENTS:
            reason = f"network: {event}{args[1:2]!r}"
        elif event.startswith(_SPAWN_PREFIXES) or event in ("subprocess.Popen", "os.kill"):
            reason = f"process control: {event}"
        elif event.startswith(("ctypes.", "os.killpg", "signal.pthread_kill")):
            reason = f"native code: {event}"
        if reason is not None:
            refusals.append(event)
            raise PermissionError(f"sandbox refused {reason}")

    return hook


def _failure(e: BaseException) -> tuple[str, str]:
    """An exception's marker: its kind and a name, never its message (the program wrote it)."""
    if isinstance(e, MemoryError):
        return "memory", "MemoryError"
    if isinstance(e, PermissionError):  # the kernel layers answer EACCES / EPERM
        return "refused", errno.errorcode.get(e.errno or 0, "PermissionError")
    return "error", type(e).__name__


def _run(code: str, spec: dict) -> tuple[str, str] | None:
    """Run the program (for a functional test, then print the returned value as the last line
    of stdout); None if it finished, else its failure marker."""
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(PRELUDE, namespace)
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
        for t in threading.enumerate():  # a program may run its main() in a bigger-stack thread
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        if spec["func_name"] is not None:
            args = [json.loads(line) for line in sys.stdin.read().splitlines() if line.strip()]
            value = getattr(namespace["Solution"](), spec["func_name"])(*args)
            line = "\n" + json.dumps(value) + "\n"
            sys.stdout.flush()
            with open(1, "w", encoding="utf-8", closefd=False) as out:
                out.write(line)
        return None
    except SystemExit as e:
        if e.code in (None, 0) and spec["func_name"] is None:
            return None
        return "error", "SystemExit"
    except BaseException as e:  # the program's own failure
        if not isinstance(e, MemoryError):
            with contextlib.suppress(Exception):
                traceback.print_exception(e)
        return _failure(e)


def _finish(failure: tuple[str, str] | None) -> NoReturn:
    """Exit 0 if the program finished, else write its marker to stderr and exit 1."""
    if failure is not None:
        with contextlib.suppress(OSError):
            os.write(2, f"\nsandbox: {failure[0]} {failure[1]}\n".encode())
    os._exit(1 if failure else 0)  # no atexit handlers or leftover daemon threads of the program


def _confine(root: str, code: str, spec: dict) -> dict:
    """Apply every layer but seccomp and the audit hook; the layers that hold. A box or
    privilege change the parent asked for that fails stops the run instead (fails closed)."""
    reads = read_roots()
    layers: dict = {"rlimits": set_limits(spec), "box_tmpfs_mb": 0}
    try:
        if spec["box_mb"]:
            box_tmpfs(root, spec["box_mb"], spec["drop_uid"])
            layers["box_tmpfs_mb"] = spec["box_mb"]
        if spec["drop_uid"] is not None:
            expose(reads, spec["drop_uid"], root)
        layers["landlock_abi"] = landlock(root, reads)
        layers["capabilities_dropped"] = drop_privileges(spec["drop_uid"])
        if layers["box_tmpfs_mb"]:  # tracebacks quote the program from its file
            with open("solution.py", "w", encoding="utf-8") as f:
                f.write(code)
    except OSError:
        traceback.print_exc()
        _finish(("error", "SandboxSetupError"))
    layers["uid"] = os.geteuid()
    return layers


def main() -> None:
    spec = json.loads(sys.argv[1])
    root = os.path.realpath(os.getcwd())
    with open("solution.py", encoding="utf-8") as f:
        code = f.read()
    layers = _confine(root, code, spec)
    layers["seccomp"] = seccomp()
    refusals: list[str] = []
    if spec["audit_hook"]:
        sys.addaudithook(audit_hook(root, refusals))
    layers["audit_hook"] = spec["audit_hook"]
    if spec["report"]:  # protections() asks, running a program of its own
        print(json.dumps(layers), flush=True)
    thread_failures: list[tuple[str, str]] = []
    threading.excepthook = lambda a: thread_failures.append(_failure(a.exc_value))
    failure = _run(code, spec) or next(iter(thread_failures), None)
    if refusals:
        failure = ("refused", refusals[0])
    try:
        sys.stdout.flush()
    except OSError as e:  # e.g. EFBIG: the output passed its size limit
        failure = failure or _failure(e)
    _finish(failure)


if __name__ == "__main__":
    main()
