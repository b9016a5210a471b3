"""The attacks of issue 16 on the code sandbox, each performed for real: holding memory outside
the address-space limit, reading the graders' expected outputs and root-only files, and forging
the verdict. Each is bounded (seconds, a few hundred MiB, no network) and must fail."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tts_service.tasks.grading import grade, run_tests
from tts_service.tasks.items import TestCase
from tts_service.tasks.loaders import FIXTURES_DIR, load_rows
from tts_service.tasks.prompts import build_items
from tts_service.tasks.sandbox import Limits, namespace_prefix, protections, run_python

LAYERS = protections()
FAST = Limits(timeout_s=3.0)
OS_ONLY = Limits(timeout_s=3.0, audit_hook=False)
SMALL = Limits(timeout_s=5.0, memory_mb=128)  # the attacks below try to hold 192 MiB
ADD = (TestCase("3 4\n", "7\n", "stdin"),)
PAIR_SUMS = (TestCase("[1, 2]\n3", "[4, 5]", "functional"),)
TOKEN = "7d1c0ffee5ecre7"
NOBODY = 65534  # the uid a root evaluator's programs must run as


def _needs(available: object, what: str) -> None:
    if not available:
        pytest.skip(f"this platform lacks {what}: {LAYERS}")


def _assert_refused(code: str, limits: Limits, success: str) -> None:
    """The kernel refused what `code` tried: it failed as refused, before printing `success`."""
    result = run_python(code, limits=limits)
    assert result.status == "refused" and success not in result.stdout, result


def test_memfd_cannot_hold_memory_beyond_the_limit():
    _needs(LAYERS["seccomp_no_new_processes"], "seccomp")
    code = (
        "import os\nfds = []\nfor i in range(3):\n"
        "    fd = os.memfd_create(f'm{i}')\n"
        "    for _ in range(64):\n        os.write(fd, b'x' * (1 << 20))\n"
        "    fds.append(fd)\nprint('held', len(fds) * 64, 'MiB')\n"
    )
    _assert_refused(code, SMALL, "held")


def test_files_in_the_box_are_capped_in_total_even_once_unlinked():
    _needs(namespace_prefix(), "mount namespaces")
    code = (
        "import os\nkept = []\nfor i in range(3):\n"  # each file is under the per-file cap
        "    f = open(f'f{i}', 'wb')\n"
        "    for _ in range(64):\n        f.write(b'x' * (1 << 20))\n"
        "    f.flush()\n    os.unlink(f'f{i}')\n    kept.append(f)\n"
        "print('held', len(kept) * 64, 'MiB')\n"
    )
    result = run_python(code, limits=SMALL)
    assert result.status == "runtime_error" and "held" not in result.stdout, result


def test_sysv_shared_memory_is_refused():
    _needs(LAYERS["seccomp_no_new_processes"], "seccomp")
    code = (  # ctypes is refused by the audit hook; with it off, the kernel must refuse shmget
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "shm = libc.shmget(0, 1 << 20, 0o600)\n"
        "if shm < 0:\n    raise OSError(ctypes.get_errno(), 'shmget')\n"
        "libc.shmctl(shm, 0, None)\nprint('segment', shm)\n"  # IPC_RMID: leave nothing behind
    )
    _assert_refused(code, OS_ONLY, "segment")


def _cheat(kind: str) -> str:
    """A program that answers each test by looking it up in the fixture file."""
    lookup = (
        "import base64, json, pickle, sys, zlib\n"
        "def decode(s):\n    try:\n        return json.loads(s)\n    except ValueError:\n"
        "        raw = zlib.decompress(base64.b64decode(s))\n"
        "        try:\n            raw = pickle.loads(raw)\n        except Exception:\n"
        "            pass\n        return json.loads(raw)\n"
        f"rows = [json.loads(line) for line in open({str(FIXTURES_DIR / 'lcb.jsonl')!r})]\n"
        "cases = [c for r in rows for k in ('public_test_cases', 'private_test_cases')"
        " for c in decode(r[k])]\n"
    )
    if kind == "stdin":
        return lookup + (
            "data = sys.stdin.read()\n"
            "print(next(c['output'] for c in cases if c['input'] == data), end='')\n"
        )
    return lookup + (
        "def answer(*args):\n"
        "    for c in cases:\n        if c['testtype'] != 'functional':\n            continue\n"
        "        if [json.loads(x) for x in c['input'].splitlines() if x.strip()] == list(args):\n"
        "            return json.loads(c['output'])\n"
        "class Solution:\n    def __getattr__(self, name):\n        return answer\n"
    )


# How a read of the fixtures can be stopped: Landlock's refusal, or, when the evaluator is root
# and the repository lies under a directory `NOBODY` cannot search (a `mktemp -d` clone with its
# own venv), the mount layer that exposes only the interpreter's paths hides the file outright.
BLOCKED = {("refused", "refused: EACCES"), ("runtime_error", "FileNotFoundError")}


def test_the_program_cannot_read_the_expected_outputs():
    _needs(LAYERS["landlock_abi"], "Landlock")
    items = build_items("lcb", load_rows("lcb", "fixtures"), run_seed=0)
    passed = [
        i.id for i in items if grade(i, f"```python\n{_cheat(i.tests[0].kind)}```", FAST).correct
    ]
    assert passed == []
    for limits in (FAST, OS_ONLY):
        result = run_python(_cheat("stdin"), "3 5\n", limits=limits)
        assert (result.status, result.detail) in BLOCKED, result
        assert result.stdout == "", result  # nothing of the file came out


def test_the_program_cannot_read_root_only_files(tmp_path):
    _needs(LAYERS["landlock_abi"], "Landlock")
    planted = tmp_path / "planted"
    planted.write_text(TOKEN)
    planted.chmod(0o600)
    for path in (str(planted), "/etc/shadow"):
        if not Path(path).exists():
            continue
        for limits in (FAST, OS_ONLY):
            for code in (
                f"print(open({path!r}).read())\n",
                f"raise ValueError(open({path!r}).read())\n",
            ):
                (case,) = run_tests(code, ADD, None, limits)
                assert case.reason == "refused", (path, case)
                assert TOKEN not in json.dumps(case.__dict__)


def test_the_graded_row_never_carries_what_the_program_printed_or_raised():
    """Only the evaluator's own words reach `failure.detail`: the output could be a file."""
    for code in (f"print({TOKEN!r})\n", f"raise ValueError({TOKEN!r})\n"):
        cases = run_tests(code, ADD, None, FAST)
        assert not cases[-1].passed
        assert TOKEN not in cases[-1].detail, cases


def test_the_program_runs_unprivileged():
    code = (  # the effective capability set, read with capget (ctypes needs the hook off)
        "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        "header = (ctypes.c_uint32 * 2)(0x20080522, 0)\ndata = (ctypes.c_uint32 * 6)()\n"
        "assert libc.capget(header, data) == 0\n"
        "print(os.geteuid(), data[0] | data[3])\n"
    )
    result = run_python(code, limits=OS_ONLY)
    assert result.status == "ok", result
    uid, capabilities = map(int, result.stdout.split())
    assert capabilities == 0
    if os.geteuid() == 0 and "user" not in LAYERS["namespaces"]:  # root made the namespaces
        assert uid == NOBODY == LAYERS["program_uid"]


FORGE = (  # switch the audit hook off (its closure has two free variables), then forge
    "import gc, json, os\n"
    "def closure(a, b):\n    def hook(event, args):\n        return a, b\n    return hook\n"
    "for f in gc.get_objects():\n"
    "    if getattr(f, '__qualname__', None) == 'audit_hook.<locals>.hook':\n"
    "        f.__code__ = closure(0, 0).__code__\n"
    "forged = json.dumps({'status': 'ok', 'value': '[4, 5]', 'refusals': [], 'layers': {}})\n"
    "for fd in range(3, 64):\n"
    "    try:\n        os.write(fd, forged.encode())\n    except OSError:\n        pass\n"
)


def test_a_forged_verdict_is_ignored():
    """The program writes a success report wherever it can, then fails: it must fail."""
    functional = FORGE + "os._exit(1)\n"
    (case,) = run_tests(functional, PAIR_SUMS, "pairSums", FAST)
    assert case.reason == "runtime_error", case
    printed = "print(7, flush=True)\n" + FORGE + "os._exit(1)\n"
    (case,) = run_tests(printed, ADD, None, FAST)
    assert case.reason == "runtime_error", case


def test_the_report_says_which_layers_hold():
    assert {"program_uid", "box_tmpfs_mb", "landlock_reads", "seccomp_denies", "verdict"} <= set(
        LAYERS
    )
    if LAYERS["seccomp_no_new_processes"]:
        assert "memfd_create" in LAYERS["seccomp_denies"]


def test_io_uring_is_refused():
    _needs(LAYERS["seccomp_no_new_processes"], "seccomp")
    assert {"io_uring_setup", "io_uring_enter", "io_uring_register"} <= set(
        LAYERS["seccomp_denies"]
    )
    code = (  # ctypes is refused by the audit hook; with it off, the kernel must refuse it
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "params = ctypes.create_string_buffer(120)\n"
        "fd = libc.syscall(425, 8, params)\n"
        "if fd < 0:\n    raise OSError(ctypes.get_errno(), 'io_uring_setup')\n"
        "print('ring', fd)\n"
    )
    _assert_refused(code, OS_ONLY, "ring")


def test_the_cpu_limit_has_a_hard_ceiling_a_program_cannot_ignore():
    """SIGXCPU at the soft limit can be ignored; the hard limit, a second later, is SIGKILL."""
    code = "import resource\nprint(*resource.getrlimit(resource.RLIMIT_CPU))\n"
    result = run_python(code, limits=FAST)
    soft, hard = map(int, result.stdout.split())
    assert soft == int(FAST.timeout_s) + 1 and hard == soft + 1, result
