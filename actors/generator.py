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

from store.base import NgramStore
from store.factory import open_global_store, open_problem_store
from tts_service.config import JobConfig, default_max_rows
from tts_service.engine.batch import BatchDecoder
from tts_service.generation import Generator
from tts_service.runner import RunnerLoop, TrajectoryRequest, TrajectoryRunner


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

    def to_dict(self) -> dict:
        return asdict(self)


class GeneratorActor:
    """`generator` and `decoder` given: a tensor-parallel replica's rank 0 (`actors.tp`), whose
    loaded shard and mirrored decoder are used as they are; its steps share `token_budget` out
    over the rows (`speculation="fixed"`): measuring the cost surface would time forwards
    that the other ranks do not mirror."""

    def __init__(
        self,
        cfg: JobConfig,
        store_url: str | None = None,
        generator: Generator | None = None,
        decoder: BatchDecoder | None = None,
    ) -> None:
        self.cfg = cfg
        self.store_url = store_url
        self.generator = generator or Generator.load(cfg.model)
        self.name = f"pid{os.getpid()}"
        self.global_store = open_global_store(cfg.store, store_url)  # across problems
        self._stores: OrderedDict[str, NgramStore] = OrderedDict()  # scope id -> store
        self._stores_lock = threading.Lock()  # calls run in concurrent threads
        self.max_rows = cfg.max_rows or default_max_rows(str(self.generator.loaded.device))
        if decoder is not None:
            runner = TrajectoryRunner(self.generator, self.max_rows, "fixed", decoder=decoder)
        else:
            runner = TrajectoryRunner(self.generator, self.max_rows)
        self.loop = RunnerLoop(runner)

    def ready(self) -> str:
        return self.name

    def close(self) -> None:
        """The actor's last call (the job's end): every store pushes what it queued, waiting
        a bounded time, and reports what it could not (the actor's stderr)."""
        with self._stores_lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for store in stores:
            store.close()
        if self.global_store is not None:
            self.global_store.close()

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
                self._stores[scope_id] = open_problem_store(
                    self.cfg.store, self.store_url, scope_id, self.global_store
                )
            store = self._stores[scope_id]
        if dropped is not None:
            dropped.close()  # outside the lock: it may wait for Redis
        return store

    def run(self, job_id: str, problem_id: str, question: str, indices: list[int]) -> list[dict]:
        """Decode trajectories `indices` of a problem (seeds: sampling.seed + index).

        Calls may arrive concurrently (the pool keeps several in flight): their trajectories
        share the actor's one continuously batched runner."""
        gen, cfg = self.generator, self.cfg
        ids = gen.encode(question, chat=cfg.chat)
        store = self._store(job_id, problem_id)
        requests = [
            TrajectoryRequest(
                problem_id,
                i,
                ids,
                cfg.sampling.model_copy(update={"seed": cfg.sampling.seed + i}),
                cfg.drafter,
                store,
                record=cfg.log_trajectories,
            )
            for i in indices
        ]
        report = self.loop.run(requests)
        records = []
        for res in sorted(report.results, key=lambda r: r.request.index):
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
            ).to_dict()
            if res.top_ids is not None:  # only when logging: the replay format needs them
                rec["prompt_ids"] = ids
                rec["top_ids"], rec["top_probs"] = res.top_ids, res.top_probs
            records.append(rec)
        return records
