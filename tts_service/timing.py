"""What the user waits for: a command's whole wall time from its process's start, split into
setup (imports, model load, store, Ray, the cost prior) and decoding, and one status line per
slow phase. The runner's own report times only its decoding, which can be a small part of it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

_IMPORTED = time.perf_counter()  # the fallback start: this module loads early in every entry
TIMING_KEYS = ("wall_s", "setup_s", "decode_s", "tokens_per_s", "decode_tokens_per_s")


def process_started() -> float:
    """When this process started, on the `time.perf_counter` clock: its start time in
    /proc/self/stat against /proc/uptime (both since boot, 10 ms ticks); where /proc cannot be
    read, when this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()  # the name in (...) may hold spaces
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return time.perf_counter() - max(age, 0.0)


def with_setup(stats: dict, started: float) -> dict:
    """`stats` as the user saw them: `metrics.summarize`'s dict, whose `wall_s` is the decoding's
    alone, with `wall_s` from `started` (a `time.perf_counter` value) to now, `decode_s` the
    decoding's, `setup_s` the rest, and tokens/s over each."""
    tokens, decode = stats["new_tokens"], stats["wall_s"]
    wall = round(time.perf_counter() - started, 4)
    return {k: v for k, v in stats.items() if k not in ("wall_s", "tokens_per_s")} | {
        "wall_s": wall,
        "setup_s": round(wall - decode, 4),
        "decode_s": decode,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "decode_tokens_per_s": round(tokens / decode, 3) if decode > 0 else 0.0,
    }


def status(line: str) -> None:
    """One status line on stderr, above any progress bar."""
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def first_token() -> None:
    """The status line that ends the wait before decoding: how long after the process's start
    the first token committed."""
    status(f"[tts] first token after {time.perf_counter() - process_started():.1f} s")


@contextmanager
def phase(doing: str, done: str) -> Iterator[None]:
    """`doing ...` as a phase starts and `done in 3.1 s` as it ends, so that no wait is
    silent."""
    status(f"{doing} ...")
    begun = time.perf_counter()
    yield
    status(f"{done} in {time.perf_counter() - begun:.1f} s")
