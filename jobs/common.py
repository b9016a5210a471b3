"""What the job entrypoints share: a validated `JobConfig` from a preset plus overrides, the
checks before Ray, a local or attached Ray, and progress lines.

`best_of_n` and `evaluate` differ only in their inputs and in what they write; both run
trajectories through `jobs.actor_set.run_missing`, so retries, resume and
placement behave the same in each.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import ValidationError
from tqdm import tqdm

from tts_service.config import first_error, load_yaml
from tts_service.drafters.registry import (
    DEFAULT_METHOD,
    METHOD_NAMES,
    METHODS,
    method_drafter,
    resolve_method,
)
from tts_service.engine.metrics import ForwardStats, GenerationStats, summarize
from tts_service.schemas import JobConfig
from tts_service.timing import phase


class JobInputError(ValueError):
    """Bad configuration or input: exit code 2, before any actor starts."""


def output_dir(path: str | Path) -> Path:
    """`--out`, checked before anything runs (created later, by the run).

    Raises:
        JobInputError: it, or the nearest of its parents that exists, is not a writable
            directory."""
    out = Path(path)
    try:
        existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    except OSError as e:  # a parent that cannot be searched
        raise JobInputError(f"--out: cannot write results to {out}: {e.strerror}") from e
    if not existing.is_dir():
        raise JobInputError(f"--out: cannot write results to {out}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JobInputError(f"--out: cannot write results to {out}: {existing} is not writable")
    return out


def apply_overrides(data: dict, sets: list[str]) -> dict:
    """`key.sub=value` (YAML value) into a nested dict."""
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise JobInputError(f"--set: expected key=value, got {item!r}")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise JobInputError(f"--set: {key!r} goes through a non-mapping")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def with_method(data: dict, method: str | None, device: str) -> dict:
    """The preset with its drafter set by `method` (`--method`), else by its `method:` key, else
    by DEFAULT_METHOD when it names no drafter either; `auto` resolves for `device`. The
    preset's drafter fields are kept when the method's drafter has the same kind."""
    named = data.pop("method", None)
    method = method or named or (None if "drafter" in data else DEFAULT_METHOD)
    if method is None:
        return data
    if method not in METHOD_NAMES:
        raise JobInputError(f"--method: unknown {method!r} (choose {', '.join(METHOD_NAMES)})")
    kind = METHODS[resolve_method(method, device)].kind
    preset = dict(data.get("drafter") or {})
    fields = preset if preset.pop("kind", kind) == kind else {}
    data["drafter"] = method_drafter(method, {kind: fields}, device)
    return data


MODEL_HELP = (
    "the model (model.name): an alias (smollm2-135m), a local directory or a hub id "
    "(docs/real-models.md); a --set still wins over it"
)


def with_model(name: str | None) -> Callable[[dict], dict]:
    """`--model` as a change to the preset (None: none)."""

    def update(data: dict) -> dict:
        if name is not None:
            data["model"] = {**(data.get("model") or {}), "name": name}
        return data

    return update


def load_config(
    path: str | Path,
    sets: list[str],
    updates: Callable[[dict], dict] | None = None,
    method: str | None = None,
) -> JobConfig:
    """The preset at `path`, its drafter set by `method` (`with_method`), changed by `updates`
    (a job's own flags), then by `--set`s.

    Raises:
        JobInputError: an unreadable preset or an invalid field (the message names it).
    """
    try:
        data = load_yaml(path)
        if updates is not None:
            data = updates(data)
        final = apply_overrides(copy.deepcopy(data), sets)  # the device the job will run on
        data = with_method(data, method, (final.get("model") or {}).get("device", "auto"))
        cfg = JobConfig.model_validate(apply_overrides(data, sets))
    except JobInputError:
        raise
    except ValidationError as e:
        loc, msg = first_error(e)
        raise JobInputError(f"{'.'.join(loc)}: {msg}") from e
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise JobInputError(f"--config: {e}") from e
    check_shards(cfg)
    return cfg


def check_shards(cfg: JobConfig) -> None:
    """Raise JobInputError unless `tensor_parallel` ranks divide the model's heads (read from
    its config; nothing loads)."""
    if cfg.tensor_parallel == 1:
        return
    from tts_service.model_check import ModelNotFoundError
    from tts_service.models import check_tensor_parallel

    try:
        check_tensor_parallel(cfg.model, cfg.tensor_parallel)
    except ModelNotFoundError as e:
        raise JobInputError(f"model.name: {e}") from e
    except (OSError, ValueError) as e:
        raise JobInputError(f"tensor_parallel: {e}") from e


def job_id_for(out: Path) -> str:
    """Store scopes and trajectory keys of a job: stable across re-runs into the same `out`."""
    return hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]


# How the work is spread and retried, not what a trajectory is: a resume may change these.
JOB_PRESET = Path(__file__).resolve().parents[1] / "configs" / "best_of_16.yaml"
"""The jobs' default preset, wherever they are run from (the repository's configs/)."""

EXECUTION_FIELDS = frozenset(
    {
        "replicas",
        "tensor_parallel",
        "sharding",
        "cpus_per_replica",
        "gpu_memory_gb",
        "placement_timeout_s",
        "batch",
        "max_rows",
        "max_retries",
        "log_trajectories",
        "confidence",
    }
)


def run_settings(cfg: JobConfig) -> dict:
    """The settings a resumed run must share with the trajectories it reuses (how speculation
    prices trees changes how fast they come, never what they are)."""
    exclude: dict = dict.fromkeys(EXECUTION_FIELDS, True)
    exclude["model"] = {"cost_model", "cost_cache"}
    return cfg.model_dump(mode="json", exclude=exclude)


def first_difference(before: object, now: object, path: str = "") -> str | None:
    """`sampling.max_new_tokens=128, not 256`: the first field where two settings differ."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(before.keys() | now.keys()):
            found = first_difference(before.get(key), now.get(key), f"{path}{key}.")
            if found:
                return found
        return None
    return None if before == now else f"{path.rstrip('.')}={before!r}, not {now!r}"


def init_ray(cfg: JobConfig) -> None:
    """The cluster at RAY_ADDRESS (set by `ray job submit`, or by hand), else a private local
    Ray on 127.0.0.1 sized for the replicas (`actors/cluster.py`)."""
    from actors.cluster import connect

    with phase("[job] starting Ray", "[job] Ray ready"):
        using = connect(
            num_cpus=max(
                2, math.ceil(cfg.cpus_per_replica * cfg.tensor_parallel * (cfg.replicas or 1))
            ),
            object_store_memory=500 * 1024**2,
        )
    print(f"[job] Ray: {using}", flush=True)
    stop_on_sigterm()


class JobStopped(KeyboardInterrupt):
    """SIGTERM arrived: the job stops as on Ctrl-C, keeping what finished."""


_signals: list[int] = []  # the stopping signals received, in order


def stop_on_sigterm() -> None:
    """SIGTERM raises `JobStopped` in the main thread, as Ctrl-C raises KeyboardInterrupt
    (after Ray's init, whose own handler exits the interpreter mid-work: the job then died
    of SIGABRT, status -6, in Ray's teardown). The signal is noted, since Ray's waits may turn
    the exception into a plain KeyboardInterrupt."""

    def stop(signum: int, frame: object) -> None:
        _signals.append(signum)
        raise JobStopped

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def stopped(prog: str) -> int:
    """A job stopped by SIGTERM or Ctrl-C: Ray shut down here (not in the interpreter's exit),
    the resume hint printed; the status a supervisor reads as stopped by that signal (143 for
    SIGTERM, 130 for SIGINT)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    sig = signal.Signals(_signals[0] if _signals else signal.SIGINT)
    print(
        f"{prog}: stopped by {sig.name}; every finished trajectory is kept in --out: run the "
        "same command to resume",
        file=sys.stderr,
        flush=True,
    )
    return 128 + sig


def check_run(cfg: JobConfig, here: bool | None = None) -> None:
    """What a run needs, checked in the driver before Ray starts (a second or two): the model is
    there (`tts_service.model_check`) and the store answers. Raises JobInputError naming the
    field. `here` False (default: whether RAY_ADDRESS names a cluster) the actors run on other
    nodes: a hub model this node neither caches nor reaches passes with a warning."""
    from actors.cluster import cluster_address
    from tts_service.model_check import ModelNotFoundError, check_model

    here = cluster_address() is None if here is None else here
    try:
        warning = check_model(cfg.model.name, here=here)
    except ModelNotFoundError as e:
        raise JobInputError(f"model.name: {e}") from e
    if warning:
        print(f"[job] warning: {warning}", flush=True)
    if cfg.store.url == "local-redis":
        return
    from store.factory import check_store
    from store.redis_client import StoreUnavailableError

    try:
        check_store(cfg.store, cfg.store.url)
    except (StoreUnavailableError, ValueError) as e:  # down, or a malformed URL
        raise JobInputError(f"store.url: {e}") from e


def generation_stats(stats: dict) -> GenerationStats:
    """A trajectory record's `stats` (`GenerationStats.to_dict()`, or an endpoint's subset)."""
    names = {f.name for f in dataclasses.fields(GenerationStats)}
    return GenerationStats(**{k: v for k, v in stats.items() if k in names})


class Progress:
    """Progress of a job's trajectories: a tqdm bar when stderr is a terminal, else one
    `[job] trajectories 12/48 problems 2/12 35.2 tok/s` line per trajectory. tok/s is
    `metrics.summarize()`'s: all new tokens over the seconds from `begin` to the latest
    trajectory (grading after it is not decoding), the figure the job's summary records."""

    def __init__(self, num_trajectories: int, num_problems: int) -> None:
        self.start = self.latest = time.perf_counter()
        self.totals = (num_trajectories, num_problems)
        self.rows: list[GenerationStats] = []
        self.problems = 0
        self.bar = (
            tqdm(total=num_trajectories, unit="trajectory", file=sys.stderr)
            if sys.stderr.isatty()
            else None
        )

    @property
    def trajectories(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    def begin(self) -> None:
        """Start the clock (the models are loaded)."""
        self.start = self.latest = time.perf_counter()

    def summary(self) -> dict:
        return summarize(self.rows, ForwardStats(), self.latest - self.start)

    def trajectory(self, rec: dict) -> None:
        self.rows.append(generation_stats(rec["stats"]))
        self.latest = time.perf_counter()
        rate = self.summary()["tokens_per_s"]
        if self.bar is not None:
            self.bar.set_postfix_str(f"problems {self.problems}/{self.totals[1]} {rate:.1f} tok/s")
            self.bar.update()
            return
        print(
            f"[job] trajectories {self.trajectories}/{self.totals[0]} problems "
            f"{self.problems}/{self.totals[1]} {rate:.1f} tok/s",
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
