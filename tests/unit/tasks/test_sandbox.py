"""The code sandbox: attacks are stopped or refused, reported as failed test cases with a
reason, and the evaluator (this process) carries on. Each OS layer is also tested alone
(audit hook off), where this platform has it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tts_service.tasks.grading import run_tests
from tts_service.tasks.items import TestCase
from tts_service.tasks.sandbox import CHILD, Limits, protections, run_python

FAST = Limits(timeout_s=2.0)
OS_ONLY = Limits(timeout_s=2.0, audit_hook=False)
ADD = (TestCase("3 4\n", "7\n", "stdin"),)
LAYERS = protections()


def _sandbox_processes() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(CHILD).encode() in cmd:
            found.append(pid)
    return found


@pytest.fixture
def listener():
    """A TCP server on loopback that the sandboxed program will try to reach."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.setblocking(False)
    yield srv
    srv.close()


def _attacks(port: int, target: Path) -> dict[str, str]:
    return {
        "infinite loop": "while True:\n    pass\n",
        "fork bomb": "import os\nwhile True:\n    os.fork()\n",
        "10 GB allocation": "block = bytearray(10 * 1024**3)\nprint(len(block))\n",
        "network connection": (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
        ),
        "write outside its directory": f"open({str(target)!r}, 'w').write('pwned')\n",
    }


EXPECTED = {
    "infinite loop": "timeout",
    "fork bomb": "refused",
    "10 GB allocation": "memory",
    "network connection": "refused",
    "write outside its directory": "refused",
}


@pytest.mark.parametrize("limits", [FAST, OS_ONLY], ids=["all layers", "os layers alone"])
def test_each_attack_fails_its_test_case_and_the_evaluator_survives(limits, listener, tmp_path):
    if not limits.audit_hook:
        needed = (LAYERS["landlock_abi"] >= 4, LAYERS["seccomp_no_new_processes"])
        if not all(needed):
            pytest.skip(f"this platform lacks Landlock >= 4 or seccomp: {LAYERS}")
    target = tmp_path / "outside.txt"  # writable by this process, outside the sandbox dir
    port = listener.getsockname()[1]
    for name, code in _attacks(port, target).items():
        (case,) = run_tests(code, ADD, None, limits)
        assert not case.passed, name
        assert case.reason == EXPECTED[name], (name, case)
        assert case.detail, name
    assert not target.exists()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    assert _sandbox_processes() == []  # the fork bomb and the loop left nothing behind


def test_refusals_name_the_operation():
    result = run_python("import subprocess\nsubprocess.run(['ls'])\n", limits=FAST)
    assert result.status == "refused" and "subprocess.Popen" in result.detail
    result = run_python("import ctypes\nctypes.CDLL(None).fork()\n", limits=FAST)
    assert result.status == "refused" and "ctypes" in result.detail


def test_a_timeout_kills_the_whole_process_group():
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n"
    code += "while True:\n    pass\n"
    result = run_python(code, limits=Limits(timeout_s=1.0))
    assert result.status == "timeout" and result.returncode is not None
    assert _sandbox_processes() == []


def test_correct_programs_pass_stdin_and_functional_tests():
    stdin_code = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"
    assert [c.reason for c in run_tests(stdin_code, ADD, None, FAST)] == ["passed"]
    functional = (
        "class Solution:\n"
        "    def pairSums(self, nums: List[int], k: int) -> List[int]:\n"
        "        return [x + k for x in nums]\n"
    )
    cases = (TestCase("[1, 2]\n3", "[4, 5]", "functional"),)
    assert run_tests(functional, cases, "pairSums", FAST)[0].passed


def test_threads_a_bigger_stack_and_files_in_its_own_directory_are_allowed():
    code = (
        "import sys, threading\nsys.setrecursionlimit(10**6)\nthreading.stack_size(1 << 26)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def main():\n    open('scratch.txt', 'w').write('ok')\n"
        "    print(depth(int(input())), open('scratch.txt').read())\n"
        "threading.Thread(target=main).start()\n"
    )
    result = run_python(code, "20000\n", limits=FAST)
    assert (result.status, result.stdout) == ("ok", "20000 ok\n")


def test_runaway_output_and_crashes_are_runtime_errors():
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    result = run_python(flood, limits=Limits(timeout_s=5.0, max_output_mb=1))
    assert result.status == "runtime_error" and "File too large" in result.detail
    result = run_python("raise SystemExit(3)\n", limits=FAST)
    assert result.status == "runtime_error"
    assert run_python("print(1)\nraise SystemExit(0)\n", limits=FAST).status == "ok"


def test_a_sigkill_after_the_cpu_limit_was_spent_is_a_timeout():
    """The kernel's SIGKILL at the hard CPU limit (a program that ignored SIGXCPU) is the
    CPU-time limit; another SIGKILL stays a runtime error."""
    import signal

    from tts_service.tasks.sandbox import _verdict

    assert _verdict(-signal.SIGKILL, False, False, "", cpu_spent=True) == (
        "timeout",
        "CPU-time limit",
    )
    assert _verdict(-signal.SIGKILL, False, False, "")[0] == "runtime_error"
