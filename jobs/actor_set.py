"""A job's actors, from Ray to the last store flush: the store's URL (a private redis-server
for 'local-redis'), the placement groups, the generator actors (or tensor-parallel replicas)
and, while they decode, the heartbeat (`jobs.heartbeat`). `JobActors` starts them at the first
run that needs them and keeps them for the next (an evaluation's tasks and methods load the
model once), and ends them with the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.common import EXECUTION_FIELDS, Progress, init_ray
from jobs.heartbeat import Heartbeat
from tts_service.schemas import JobConfig, Problem
from tts_service.timing import phase

if TYPE_CHECKING:
    from actors.placement import PlacementPlan

SHARED_FIELDS = (
    "model",
    "store",
    *sorted(EXECUTION_FIELDS - {"log_trajectories", "confidence"}),
)
"""What every run on one set of actors shares (what they were started with); a run that differs
in any of these gets actors of its own (the sampling, the drafter, the chat template, the
trajectory log and confidence travel with each call)."""


def run_missing(
    cfg: JobConfig,
    problems: list[Problem],
    trajectories: Path,
    job_id: str,
    progress: Progress,
    on_problem: Callable,
    actors: JobActors | None = None,
) -> tuple[dict, int]:
    """What `trajectories` still lacks (`actors.pool.still_to_run`), run on `actors` (started
    at the first run that needs them and kept for the next: an evaluation's tasks; default:
    this run's own), or, when nothing is missing, each problem's state straight from the file:
    no Ray, no model. Returns (problem id -> state, retries)."""
    from actors.pool import ResultsFile, still_to_run

    states, chunks = still_to_run(cfg, problems, ResultsFile(trajectories).load())
    if chunks:
        if actors is not None:
            return actors.run(cfg, problems, trajectories, job_id, progress, on_problem)
        with JobActors() as own:
            return own.run(cfg, problems, trajectories, job_id, progress, on_problem)
    print(f"[job] nothing to run: every trajectory is in {trajectories}", flush=True)
    for state in states.values():
        on_problem(state)
    return states, 0


class JobActors:
    """The actors of one job or evaluation: `run` starts them (Ray first) for the first config
    that needs them and reuses them while the next configs share `SHARED_FIELDS`; leaving the
    block closes their stores (their last flush) and frees their reservations, or on an error
    kills tensor-parallel replicas."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.cfg: JobConfig | None = None  # what the actors were started with
        self.actors: list = []
        self.url: str | None = None  # the store's, as the actors were given it

    def __enter__(self) -> JobActors:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self._end(failed=kind is not None)

    def run(
        self,
        cfg: JobConfig,
        problems: list[Problem],
        trajectories: Path,
        job_id: str,
        progress: Progress,
        on_problem: Callable,
    ) -> tuple[dict, int]:
        """Run every missing trajectory of `problems` (appended to `trajectories`, the resume
        point); returns (problem id -> state, retries). The progress clock starts once every
        model is loaded (where a speed measurement begins)."""
        from actors.pool import ResultsFile, TrajectoryPool

        actors = self._for(cfg)
        progress.begin()
        pool = TrajectoryPool(cfg, actors, job_id, ResultsFile(trajectories))
        generators = [a for a in actors if not _tensor_parallel(a)]
        with Heartbeat(generators, progress, cfg.sampling.max_new_tokens):
            states = pool.run(problems, progress.trajectory, on_problem)
        return states, pool.retries

    def _for(self, cfg: JobConfig) -> list:
        if self.cfg is not None and all(
            getattr(self.cfg, f) == getattr(cfg, f) for f in SHARED_FIELDS
        ):
            return self.actors
        if self.cfg is not None:
            self._end(failed=False)
        init_ray(cfg)
        self._stack = contextlib.ExitStack()
        try:
            self._start(cfg)
        except BaseException:
            self._end(failed=True)
            raise
        return self.actors

    def _start(self, cfg: JobConfig) -> None:
        from ray.util.placement_group import remove_placement_group

        from actors.pool import start_actors, start_replicas

        url = self._stack.enter_context(store_url(cfg))
        placed, replicas, gpus, strategies = placed_actors(cfg)
        for strategy in strategies:  # the reservations end with the actors, not the driver
            self._stack.callback(remove_placement_group, strategy.placement_group)
        self.url = url
        with phase(
            f"[job] starting {replicas} actor(s), each loading {cfg.model.name}",
            f"[job] {replicas} actor(s) ready",
        ):
            if placed.tensor_parallel > 1:
                self.actors = start_replicas(placed, replicas, url, gpus)
            else:
                self.actors = start_actors(placed, replicas, url, gpus, strategies)
        self.cfg = cfg

    def _end(self, failed: bool) -> None:
        """Close the actors' stores (or kill replicas after an error), free what was reserved,
        stop a private redis-server."""
        from actors.pool import close_actors, kill_replicas

        try:
            if failed:
                kill_replicas(self.actors)
            elif self.actors:
                shared = close_actors(self.actors)  # while a local-redis server still runs
                if self.url is not None and shared:
                    print(store_line(shared, len(self.actors)), flush=True)
        finally:
            self.actors, self.cfg = [], None
            self._stack.close()


def _tensor_parallel(actor) -> bool:
    from actors.tp import TensorParallelReplica

    return isinstance(actor, TensorParallelReplica)


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


def store_line(totals: dict[str, float], actors: int) -> str:
    """What the job's shared store did: rows each actor took from the others, the replication
    lag, and what was lost (never silent)."""
    return (
        f"[job] store shared by {actors} actor(s): {int(totals.get('flushed_updates', 0)):,} "
        f"rows appended, {int(totals.get('remote_updates', 0)):,} merged from other actors, "
        f"lag p99 {totals.get('lag_ms_p99', 0.0):.0f} ms, lost "
        f"{int(totals.get('lost_updates', 0))}, missed {int(totals.get('missed_batches', 0))}"
    )
