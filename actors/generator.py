"""`GeneratorActor`: one model, one engine, trajectories on request.

A plain class: tests build it in-process; `actors.pool` wraps it with `ray.remote`. Its duties:
(1) load the model once, (2) open the problem's store scope (Redis when configured, so that
every actor of a job shares it), (3) decode the requested trajectory indices in its one
continuously batched runner, which concurrent calls share, (4) return small records (token
ids, text, counters), never tensors.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import ray

from store.base import NgramStore
from tts_service import startup
from tts_service.schemas import JobConfig
from tts_service.timing import phase

if TYPE_CHECKING:  # the engine (torch, transformers) loads in the actor, not in the driver
    from tts_service.engine.batch import BatchDecoder
    from tts_service.generation import Generator


@dataclass(frozen=True)
class TrajectoryRecord:
    """One finished trajectory, keyed by (problem_id, index): the unit of retry and resume."""

    problem_id: str
    index: int
    seed: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    actor: str
    node: str = ""  # the Ray node that decoded it (empty outside Ray)
    run_nonce: int | None = None  # what salted its verify stream (None: plain decoding)
    confidence: dict | None = None  # `aggregate.confidence`'s summary, with `confidence: true`

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["confidence"] is None:
            del out["confidence"]
        return out


def _ray_node() -> str:
    """This process's Ray node id, or "" outside Ray (tests build actors in-process)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


SHARED_COUNTS = ("remote_updates", "flushed_updates", "lost_updates", "missed_batches")


def add_store(totals: dict[str, float], stats: dict) -> None:
    """A closed store's replication counters into `totals` (summed; the lag: the worst p99);
    an in-process store adds nothing."""
    for key in SHARED_COUNTS:
        if key in stats:
            totals[key] = totals.get(key, 0) + stats[key]
    if stats.get("lag_ms_p99") is not None:
        totals["lag_ms_p99"] = max(totals.get("lag_ms_p99", 0.0), stats["lag_ms_p99"])


class GeneratorActor:
    """`generator` and `decoder` given: a tensor-parallel replica's rank 0 (`actors.tp`), whose
    loaded shard and mirrored decoder are used as they are (the host shares a fixed token
    budget over its rows)."""

    def __init__(
        self,
        cfg: JobConfig,
        store_url: str | None = None,
        generator: Generator | None = None,
        decoder: BatchDecoder | None = None,
    ) -> None:
        from actors.host import RunnerHost
        from tts_service.generation import Generator

        self.cfg = cfg
        self.name = f"pid{os.getpid()}"
        with startup.held():  # the model's load: no collector passes (the host settles it)
            if generator is None:
                with phase(f"[actor {self.name}] loading {cfg.model.name}", "[actor] loaded"):
                    generator = Generator.load(cfg.model, drafter=cfg.drafter)
            self.host = RunnerHost(
                generator, cfg.store, store_url, cfg.max_rows, tp_decoder=decoder, threaded=True
            )
        self.node = _ray_node()
        self._stores: OrderedDict[str, NgramStore] = OrderedDict()  # scope id -> store
        self._stores_lock = threading.Lock()  # calls run in concurrent threads
        self.store_totals: dict[str, float] = {}  # the closed stores' counters (`add_store`)
        self._cancelled: set[tuple[str, str]] = set()  # (job id, problem id): decided votes

    def ready(self) -> str:
        return self.name

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[str, int]:
        """The host's rows and tokens now: answered beside the `run` calls that fill the
        default concurrency group (`jobs.heartbeat`)."""
        return self.host.progress()

    @ray.method(concurrency_group="control")
    def cancel(self, job_id: str, problem_id: str) -> None:
        """The problem's vote is decided (`actors.pool`, early stop): its rows here leave the
        batch at the next step, and their calls return what finished."""
        self._cancelled.add((job_id, problem_id))

    def close(self) -> dict[str, float]:
        """The actor's last call (the job's end): every store pushes what it queued, waiting
        a bounded time, and reports what it could not (the actor's stderr). Returns what its
        stores counted (`add_store`: the job says whether its store was shared)."""
        with self._stores_lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for store in stores:
            self._closed(store)
        self.host.close()
        return self.store_totals

    def _closed(self, store: NgramStore) -> None:
        store.close()
        add_store(self.store_totals, store.stats())

    def _store(self, job_id: str, problem_id: str) -> NgramStore:
        """The problem's store, kept for the few problems in flight (the least recently used
        is closed)."""
        scope_id = f"{job_id}/{problem_id}"
        dropped = None
        with self._stores_lock:
            if scope_id in self._stores:
                self._stores.move_to_end(scope_id)
            else:
                if len(self._stores) >= 8:
                    _, dropped = self._stores.popitem(last=False)
                self._stores[scope_id] = self.host.problem_store(scope_id)
            store = self._stores[scope_id]
        if dropped is not None:
            self._closed(dropped)  # outside the lock: it may wait for Redis
        return store

    def run(
        self,
        job_id: str,
        problem_id: str,
        question: str,
        indices: list[int],
        attempt: int = 0,
        cfg: JobConfig | None = None,
    ) -> list[dict]:
        """Decode trajectories `indices` of a problem (seeds: sampling.seed + index), with
        `cfg`'s sampling, drafter, chat template and trajectory log (default: the actor's own;
        the rest must be the actor's: `jobs.actor_set.SHARED_FIELDS`).

        Calls may arrive concurrently (the pool keeps several in flight): their trajectories
        share the host's one continuously batched runner. A retry (`attempt` > 0) draws a new
        run nonce: the failed attempt's rows may have taught the problem's store with the
        configured one (each record says which nonce it ran with)."""
        cfg = cfg or self.cfg
        ids = self.host.generator.encode(question, chat=cfg.chat)
        store = self._store(job_id, problem_id)
        sampling = cfg.sampling
        if attempt:
            sampling = sampling.model_copy(update={"run_nonce": None})
        key = (job_id, problem_id)
        report = self.host.trajectories(
            problem_id,
            ids,
            indices,
            sampling,
            cfg.drafter,
            store,
            cfg.log_trajectories,
            skip=lambda _request: key in self._cancelled,
            confidence=cfg.confidence,
        )
        records = []
        for res in report.results:
            o = res.output
            rec = TrajectoryRecord(
                problem_id,
                res.request.index,
                res.request.sampling.seed,
                o.text,
                list(o.token_ids),
                o.finish_reason,
                o.stats.to_dict(),
                self.name,
                self.node,
                res.request.run_nonce if res.request.salted else None,
                res.confidence,
            ).to_dict()
            if res.top_ids is not None:  # only when logging: the replay format needs them
                rec["prompt_ids"] = ids
                rec["top_ids"], rec["top_probs"] = res.top_ids, res.top_probs
            records.append(rec)
        return records
