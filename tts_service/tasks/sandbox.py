"""Run untrusted Python (model-written programs) and survive whatever it does.

Each run gets a fresh temporary directory as its cwd, HOME and TMPDIR (deleted afterwards), an
isolated interpreter (`python -I -B`: no user site, no environment, no bytecode writes), and
its own session, so on a timeout the whole process group is killed with SIGKILL. Where the
platform allows, `unshare` puts it in new network, IPC and mount namespaces (no network
interface but a down loopback; SysV IPC and mounts die with the run): a root evaluator makes
them itself and the program then runs as uid `NOBODY`, anyone else adds a user namespace in
which the program keeps no capabilities. Inside, `sandbox_child.py` caps the directory as a
tmpfs and applies rlimits, Landlock (reads and writes), seccomp and an audit hook; its
docstring says what each stops, and `protections()` reports which held here.

The verdict is this process's: the exit status, the time taken, the size of the output and,
for the graders, what the program printed. Nothing the program's process reports is believed;
its last stderr line only names which failure it was (`memory`, `refused`, an exception's
name), so a program can mislabel its own failure but never pass. `RunResult.detail` (what the
graders keep) carries no text the program wrote besides such a name: its output or exception
message could hold a file's contents.

Limits of this design: memory is bounded by the address-space limit plus the box's tmpfs plus
kernel buffers (pipes, sockets) reachable through 256 open files, not by a memory cgroup (that
needs a delegated cgroup tree); without Landlock, reads and writes are confined only by the
program's uid (little for `NOBODY`, all the evaluator can reach for a non-root evaluator; files
in a world-writable tmpfs such as /dev/shm are then not capped) and the audit hook, which the
program can switch off from inside; without Landlock ABI 6 it can signal other processes of its
uid (other runs), and without Landlock trace them; without namespaces there is no box cap and
no uid change, and the program keeps the evaluator's uid (with no capabilities). RLIMIT_NPROC
is set only in a user namespace (for `NOBODY` it would count every such process on the
machine); elsewhere seccomp is the fork-bomb defence and the address-space limit bounds
threads. For hostile code use a VM or gVisor.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CHILD = Path(__file__).resolve().with_name("sandbox_child.py")
Status = Literal["ok", "timeout", "memory", "refused", "runtime_error"]
NOBODY = 65534  # the uid/gid a root evaluator's programs run as (the kernel's overflow id)
_MAX_READ = 64 << 20  # bytes of stdout kept for comparison
# the child's last stderr line when the program failed: kind and an exception or event name
_MARKER = re.compile(r"sandbox: (memory|refused|error) ([A-Za-z_][A-Za-z0-9_.]{0,79})")


@dataclass(frozen=True)
class Limits:
    """Per-run limits. `timeout_s` is wall-clock time for the whole run, interpreter start
    included; the CPU limit is one second above it. `disk_mb` is what the program may store
    in its directory (a tmpfs, so memory too), where mount namespaces exist. `audit_hook=False`
    leaves only the OS layers (tests use it to show that each of those holds on its own)."""

    timeout_s: float = 6.0
    memory_mb: int = 1024
    max_output_mb: int = 64
    disk_mb: int = 64
    max_tasks: int = 64  # processes + threads, where RLIMIT_NPROC is enforced
    audit_hook: bool = True


@dataclass(frozen=True)
class RunResult:
    """What happened, as this process saw it. `value` is the JSON text a functional call
    returned (the last line the program printed); `detail` is this process's own words plus at
    most an exception or audit-event name, never the program's output."""

    status: Status
    detail: str = ""
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command that gives each run new network, IPC and mount namespaces, or
    nothing where none works here (probed once, with a trivial program through the whole
    child set-up).

    Root makes them directly, so that the child can mount its box and then drop to `NOBODY`;
    anyone else needs a user namespace too (mapped to root inside, so the child can mount; it
    then empties its capability sets). The mount namespace is private: nothing leaks out.
    """
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    spaces = ("--net", "--ipc", "--mount")
    candidates = [(exe, *spaces)] if os.geteuid() == 0 else []
    candidates.append((exe, "--user", "--map-root-user", *spaces))
    for prefix in candidates:
        if _execute("pass", "", None, Limits(), prefix).status == "ok":
            return prefix
    return ()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL everything in the run's process group, then reap the leader."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already empty
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _verdict(
    rc: int, timed_out: bool, overflowed: bool, stderr: str, cpu_spent: bool = False
) -> tuple[Status, str]:
    """The status from how the program ended, as this process saw it. The child's marker
    (the last stderr line) only says which failure it was: a program that forges one has
    still failed. `cpu_spent`: the children used the CPU-time limit (a SIGKILL is then the
    kernel's, at the hard limit, for a program that ignored SIGXCPU)."""
    if timed_out:
        return "timeout", "wall-clock limit"
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu_spent):
        return "timeout", "CPU-time limit"
    if overflowed:
        return "runtime_error", "File too large: the output passed its size limit"
    if rc < 0:
        return "runtime_error", f"killed by {signal.Signals(-rc).name}"
    if rc == 0:
        return "ok", ""
    lines = stderr.rstrip().rsplit("\n", 1)
    marker = _MARKER.fullmatch(lines[-1].strip())
    if marker is None:
        return "runtime_error", f"exit code {rc}"
    kind, name = marker.groups()
    if kind == "memory":
        return "memory", name
    if kind == "refused":
        return "refused", f"refused: {name}"
    return "runtime_error", name


def _child_spec(
    limits: Limits, func_name: str | None, prefix: tuple[str, ...], report: bool
) -> dict:
    """What `sandbox_child.py` applies under `prefix`."""
    return {
        "func_name": func_name,
        "memory_mb": limits.memory_mb,
        "cpu_s": int(limits.timeout_s) + 1,
        "max_output_mb": limits.max_output_mb,
        # enforced only for a non-root user inside its own user namespace, where the kernel
        # counts the sandbox's tasks alone (root is exempt; outside a namespace the count
        # would include every process the user runs)
        "max_tasks": limits.max_tasks if prefix and os.geteuid() != 0 else 0,
        "audit_hook": limits.audit_hook,
        "box_mb": limits.disk_mb if prefix else 0,
        "drop_uid": NOBODY if prefix and "--user" not in prefix else None,
        "report": report,
    }


def run_python(
    code: str, stdin: str = "", func_name: str | None = None, limits: Limits | None = None
) -> RunResult:
    """Run `code` as a program fed `stdin`; with `func_name`, then call
    `Solution().<func_name>(*args)` with one JSON argument per line of `stdin`.

    Never raises for anything the program does; its failures come back as the status, which
    this process decides from the exit status, the time taken and the output's size.
    """
    return _execute(code, stdin, func_name, limits or Limits(), namespace_prefix())


def _execute(
    code: str,
    stdin: str,
    func_name: str | None,
    limits: Limits,
    prefix: tuple[str, ...],
    report: bool = False,
) -> RunResult:
    spec = _child_spec(limits, func_name, prefix, report)
    with (
        tempfile.TemporaryDirectory(prefix="tts-box-", ignore_cleanup_errors=True) as box,
        tempfile.TemporaryDirectory(prefix="tts-box-io-") as io_dir,
    ):
        Path(box, "solution.py").write_text(code, encoding="utf-8")
        files = Path(io_dir)
        (files / "stdin").write_text(stdin, encoding="utf-8")
        env = {"PATH": os.defpath, "HOME": box, "TMPDIR": box, "LANG": "C.UTF-8"}
        cmd = [*prefix, sys.executable, "-I", "-B", str(CHILD), json.dumps(spec)]
        with (
            open(files / "stdin", "rb") as fin,
            open(files / "stdout", "wb") as fout,
            open(files / "stderr", "wb") as ferr,
        ):
            start = time.perf_counter()
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.Popen(
                cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=box, env=env, start_new_session=True
            )
            try:
                proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # nothing the program started outlives the call
            wall = time.perf_counter() - start
            now = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
        overflowed = (files / "stdout").stat().st_size >= limits.max_output_mb << 20
        stdout = _read(files / "stdout", _MAX_READ)
        stderr = _read(files / "stderr", 4000, tail=True)
    status, detail = _verdict(proc.returncode, timed_out, overflowed, stderr, cpu >= spec["cpu_s"])
    value = None
    if status == "ok" and func_name is not None:
        stdout, _, value = stdout.rstrip("\n").rpartition("\n")
    return RunResult(
        status=status,
        detail=detail,
        stdout=stdout,
        stderr=stderr,
        value=value or None,
        returncode=proc.returncode,
        wall_s=round(wall, 3),
    )


def _read(path: Path, limit: int, tail: bool = False) -> str:
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, path.stat().st_size - limit))
        return f.read(limit).decode("utf-8", errors="replace")


@functools.cache
def protections() -> dict:
    """The layers that hold on this machine (cached), from one trivial run that prints what
    the child applied; a layer the platform lacks shows as 0, False or empty."""
    prefix = namespace_prefix()
    result = _execute("pass", "", None, Limits(), prefix, report=True)
    layers = json.loads(result.stdout.splitlines()[0]) if result.status == "ok" else {}
    in_userns = "--user" in prefix
    return {
        "namespaces": ["user"] * in_userns + ["network", "ipc", "mount"] * bool(prefix),
        # inside a user namespace uid 0 is the evaluator's uid outside
        "program_uid": os.geteuid() if in_userns else layers.get("uid", os.geteuid()),
        "capabilities_dropped": layers.get("capabilities_dropped", False),
        "box_tmpfs_mb": layers.get("box_tmpfs_mb", 0),
        "landlock_abi": layers.get("landlock_abi", 0),
        "landlock_reads": layers.get("landlock_abi", 0) >= 1,
        "seccomp_no_new_processes": bool(layers.get("seccomp")),
        "seccomp_denies": layers.get("seccomp", []),
        "rlimits": layers.get("rlimits", []),
        "audit_hook": layers.get("audit_hook", False),
        "evaluator_is_root": os.geteuid() == 0,
        "verdict": "from the exit status, time and output, decided by the evaluator",
        "kill_on_timeout": "SIGKILL to the process group",
    }
