"""What the job entrypoints share: a validated `JobConfig` from a preset plus overrides, a local
or attached Ray, the generator actors placed from the config, and progress lines.

`best_of_n` and `evaluate` differ only in their inputs and in what they write; both run
trajectories through `run_pool`, so retries, resume and placement behave the same in each.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import ValidationError
from tqdm import tqdm

from tts_service.config import load_yaml
from tts_service.drafters.registry import (
    DEFAULT_METHOD,
    METHOD_NAMES,
    METHODS,
    method_drafter,
    resolve_method,
)
from tts_service.engine.metrics import ForwardStats, GenerationStats, summarize
from tts_service.schemas import JobConfig, Problem
from tts_service.timing import phase

if TYPE_CHECKING:
    from actors.placement import PlacementPlan


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
        first = e.errors()[0]
        raise JobInputError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from e
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


@contextlib.contextmanager
def store_url(cfg: JobConfig) -> Iterator[str | None]:
    """The store's URL ('local-redis': a private redis-server for the run; any other was
    checked by `check_run`)."""
    if cfg.store.url != "local-redis":
        yield cfg.store.url
        return
    from store.local_server import LocalRedisServer

    with LocalRedisServer() as server:
        print(f"[job] started redis-server at {server.url}", flush=True)
        yield server.url


def placed_actors(cfg: JobConfig) -> tuple[JobConfig, int, int, list]:
    """(config, replicas, GPUs per actor, scheduling strategies), every replica's resources
    reserved as one STRICT_PACK placement group within `placement_timeout_s`. Without GPUs:
    `replicas` groups of `cpus_per_replica` CPUs. With GPUs: the placement plan sizes each
    replica from the model's parameter count and KV cache (`_gpu_plan`). Tensor-parallel
    replicas (the returned config's `tensor_parallel` > 1: a GPU per rank) reserve their own
    groups, since a restart reserves a new one, so none are returned for them.

    Raises:
        PlacementError: the cluster cannot hold the replicas (the message names the fields).
    """
    import ray

    from actors.placement import (
        PlacementError,
        PlacementPlan,
        create_placement_groups,
        scheduling_strategy,
    )

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if not gpus or cfg.model.device == "cpu":
        replicas = cfg.replicas or 1
        ranks = f" of {cfg.tensor_parallel} ranks" if cfg.tensor_parallel > 1 else ""
        reason = f"{replicas} replica(s){ranks} of {cfg.cpus_per_replica:g} CPU(s), no GPUs"
        plan = PlacementPlan(0, replicas, 0, {}, reason)
        asked = f"replicas={replicas} with cpus_per_replica={cfg.cpus_per_replica:g}"
    else:
        cfg, plan = _gpu_plan(cfg, gpus)
        asked = (
            f"{plan.num_replicas} replica(s) of {plan.gpus_per_replica} GPU(s) with "
            f"cpus_per_replica={cfg.cpus_per_replica:g}"
        )
    print(f"[job] placement: {plan.reason}", flush=True)
    if cfg.tensor_parallel > 1:
        return cfg, plan.num_replicas, 1 if plan.gpus_per_replica else 0, []
    try:
        groups = create_placement_groups(plan, cfg.cpus_per_replica, cfg.placement_timeout_s)
    except PlacementError as e:
        raise PlacementError(f"{asked} cannot be placed: {e}") from e
    return cfg, plan.num_replicas, plan.gpus_per_replica, [scheduling_strategy(g) for g in groups]


def _gpu_plan(cfg: JobConfig, gpus: int) -> tuple[JobConfig, PlacementPlan]:
    """The GPU plan for `cfg.replicas` (at most what fits; `actors.placement.plan_gpu_replicas`)
    and the config its replicas load: tensor-parallel ranks set to the plan's, or a sharded
    `device_map` replica's `max_memory`. A model that does not fit names `gpu_memory_gb`."""
    from actors.placement import PlacementError, plan_gpu_replicas

    try:
        plan = plan_gpu_replicas(cfg, gpus)
    except PlacementError as e:  # the model does not fit this cluster's GPUs
        raise PlacementError(f"gpu_memory_gb={cfg.gpu_memory_gb:g}: {e}") from e
    if cfg.sharding == "tensor_parallel":
        cfg = cfg.model_copy(update={"tensor_parallel": plan.gpus_per_replica})
    elif plan.gpus_per_replica > 1:
        memory_map = {str(k): v for k, v in plan.max_memory.items()}
        model = cfg.model.model_copy(update={"max_memory": memory_map})
        cfg = cfg.model_copy(update={"model": model})
    return cfg, plan


def run_pool(
    cfg: JobConfig,
    problems: list[Problem],
    trajectories: Path,
    job_id: str,
    on_trajectory: Callable[[dict], None] | None = None,
    on_problem: Callable | None = None,
    on_ready: Callable[[], None] | None = None,
) -> tuple[dict, int]:
    """Start the actors, run every missing trajectory (appended to `trajectories`, the resume
    point), and return (problem id -> state, retries). `on_ready` is called once every model is
    loaded, before the first trajectory starts (where a speed measurement begins)."""
    from ray.util.placement_group import remove_placement_group

    from actors.pool import (
        ResultsFile,
        TrajectoryPool,
        close_actors,
        kill_replicas,
        start_actors,
        start_replicas,
    )

    with store_url(cfg) as url:
        placed_cfg, replicas, gpus, strategies = placed_actors(cfg)
        actors: list = []
        try:
            with phase(
                f"[job] starting {replicas} actor(s), each loading {cfg.model.name}",
                f"[job] {replicas} actor(s) ready",
            ):
                if placed_cfg.tensor_parallel > 1:
                    actors = start_replicas(placed_cfg, replicas, url, gpus)
                else:
                    actors = start_actors(placed_cfg, replicas, url, gpus, strategies)
            if on_ready is not None:
                on_ready()
            pool = TrajectoryPool(cfg, actors, job_id, ResultsFile(trajectories))
            states = pool.run(problems, on_trajectory, on_problem)
            shared = close_actors(actors)  # while a local-redis server still runs
            if url is not None and shared:
                print(store_line(shared, len(actors)), flush=True)
        except BaseException:
            kill_replicas(actors)
            raise
        finally:  # the reservations (and the actors in them) end with the run, not the driver
            for strategy in strategies:
                remove_placement_group(strategy.placement_group)
    return states, pool.retries


def store_line(totals: dict[str, float], actors: int) -> str:
    """What the job's shared store did: rows each actor took from the others, the replication
    lag, and what was lost (never silent)."""
    return (
        f"[job] store shared by {actors} actor(s): {int(totals.get('flushed_updates', 0)):,} "
        f"rows appended, {int(totals.get('remote_updates', 0)):,} merged from other actors, "
        f"lag p99 {totals.get('lag_ms_p99', 0.0):.0f} ms, lost "
        f"{int(totals.get('lost_updates', 0))}, missed {int(totals.get('missed_batches', 0))}"
    )


def run_missing(
    cfg: JobConfig,
    problems: list[Problem],
    trajectories: Path,
    job_id: str,
    progress: Progress,
    on_problem: Callable,
) -> tuple[dict, int]:
    """`run_pool` over Ray for what `trajectories` still lacks (`actors.pool.still_to_run`), or,
    when nothing is missing, each problem's state straight from the file: no Ray, no model.
    Returns (problem id -> state, retries)."""
    from actors.pool import ResultsFile, still_to_run

    states, chunks = still_to_run(cfg, problems, ResultsFile(trajectories).load())
    if chunks:
        init_ray(cfg)
        return run_pool(
            cfg, problems, trajectories, job_id, progress.trajectory, on_problem, progress.begin
        )
    print(f"[job] nothing to run: every trajectory is in {trajectories}", flush=True)
    for state in states.values():
        on_problem(state)
    return states, 0


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
