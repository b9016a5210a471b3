"""HuggingFace math-verify in a child process: answer extraction and equivalence for math.

math-verify bounds its own work with `signal.alarm`, which only works in the main thread; the
vote runs in Ray actors' and Serve's threads. So its timeouts are off, and it runs here in one
long-lived child per process (started on first use), which the caller kills when a request
overruns: sympy cannot be interrupted and may hang or exhaust memory on model output such as
`2^{2^{2^{2^{2^{5}}}}}`. The next request starts a fresh child. math-verify and sympy are
imported in the child only, so the CPU-side aggregator stays light.

This file is also the child (`python -I mathverify.py`): stdlib imports only at the top, and it
reads one JSON request per line on stdin and writes one JSON reply per line on stdout.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine takes seconds
_MEMORY_LIMIT = 2 << 30  # bytes of address space for the child
_READY = "ready"


class _Child:
    """The child process and its pipes; one request at a time (a lock serialises threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0  # the parent that started the child: a forked copy starts its own

    def _start(self) -> subprocess.Popen[bytes]:
        # -I: neither the working directory nor PYTHONPATH can shadow math-verify or sympy.
        proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        if (_read_line(proc, time.monotonic() + STARTUP_TIMEOUT_S) or "").strip() != _READY:
            _kill(proc)
            raise RuntimeError(
                f"the math-verify child did not start (exit code {proc.returncode}; its "
                "stderr says why); is math-verify installed?"
            )
        self._proc, self._pid = proc, os.getpid()
        return proc

    def request(self, payload: dict[str, Any], timeout_s: float) -> Any:
        """The child's reply to one request, or None if it overran `timeout_s` or failed.

        Raises:
            RuntimeError: if the child cannot start at all (math-verify missing or broken).
        """
        with self._lock:
            proc = self._proc if self._pid == os.getpid() else None
            if proc is not None and proc.poll() is not None:
                _kill(proc)  # died (out of memory?): reap it and close its pipes
                proc = None
            if proc is None:
                proc = self._start()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps(payload).encode() + b"\n")
                proc.stdin.flush()
                line = _read_line(proc, time.monotonic() + timeout_s)
            except OSError:
                line = None
            if line is None:
                _kill(proc)
                self._proc = None
                return None
            return json.loads(line)["result"]


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str | None:
    """One line from the child's stdout by `deadline`, or None (timeout or exit).

    Reads the raw descriptor, so no buffered bytes can hide from `select`.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        data += chunk
    return data.decode()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


_CHILD = _Child()


def extract(text: str, timeout_s: float) -> str | None:
    """The math answer `text` commits to, as math-verify extracted it; None if none or timeout."""
    return _CHILD.request({"op": "extract", "text": text}, timeout_s)


def equal(a: str, b: str, timeout_s: float) -> bool:
    """Whether math-verify finds the answers `a` (as gold) and `b` equal; False on a timeout."""
    return bool(_CHILD.request({"op": "equal", "a": a, "b": b}, timeout_s))


# ----------------------------------------------------------------------------------- the child


def _serve() -> None:
    """The child's loop: import math-verify, say ready, then answer requests until stdin ends."""
    import functools
    import logging
    import re
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_MEMORY_LIMIT, _MEMORY_LIMIT))
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Timeouts are off (no signals in threads); it warns once about that, and the parent's
    # deadline is the timeout. Other warnings would only spam the parent's stderr.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # math-verify's default extraction, LaTeX and plain expressions alike: the last `\boxed{}`
    # or "final answer is X" first, then "answer: X", then the last expression in the text.
    configs = (LatexExtractionConfig(), ExprExtractionConfig())
    sci = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)")

    def extract_text(text: str) -> str | None:
        # "first_match": the value and the string come from the same match. One it cannot parse
        # (`\text{Monday}`) comes back as the string alone, which still votes with its equals.
        found = parse(text, configs, extraction_mode="first_match", parsing_timeout=None)
        return found[-1] if found and isinstance(found[-1], str) and found[-1] else None

    @functools.lru_cache(maxsize=1024)
    def parse_answer(answer: str) -> tuple[Any, ...]:
        answer = " ".join(answer.replace("$", " ").split())
        if m := sci.fullmatch(answer):  # `1.5e3`: neither extraction config reads e-notation
            answer = f"{m[1]}\\times10^{{{m[2]}}}"
        return tuple(parse(f"${answer}$", configs, parsing_timeout=None))

    def handle(req: dict[str, Any]) -> Any:
        if req["op"] == "extract":
            return extract_text(req["text"])
        gold, target = parse_answer(req["a"]), parse_answer(req["b"])
        return verify(list(gold), list(target), timeout_seconds=None)

    replies, sys.stdout = sys.stdout, sys.stderr  # a library's print must not garble a reply
    print(_READY, file=replies, flush=True)
    for line in sys.stdin:
        try:
            result = handle(json.loads(line))
        except Exception:  # MemoryError included: one bad answer must not end the child
            result = None
        print(json.dumps({"result": result}), file=replies, flush=True)


if __name__ == "__main__":
    _serve()
