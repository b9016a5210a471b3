"""The trajectory pool: spreads every problem's N trajectories over generator actors, streams
results in finish order, retries what a dead actor lost, and writes each trajectory the moment
it finishes, so a crash loses nothing and a re-run resumes where it stopped.

Each trajectory is keyed by (problem id, index). Calls carry a chunk of indices of one
problem; a chunk whose actor died is resubmitted, and a second result for a key is dropped,
so nothing is lost or doubled.

A replica is a generator actor (Ray restarts it) or a tensor-parallel replica (`actors.tp`:
the pool calls its rank 0 and watches its followers). A tensor-parallel replica one of whose
ranks died is restarted as a whole by the pool, and every chunk it had in flight resubmitted.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import ActorUnavailableError, RayError, RayTaskError

from actors.generator import GeneratorActor, add_store
from actors.tp import TensorParallelReplica
from tts_service.aggregate import extract_answer
from tts_service.aggregate.early_stop import decided_vote
from tts_service.config import default_max_rows
from tts_service.schemas import JobConfig, Problem

log = logging.getLogger(__name__)
AVOID_S = 30.0  # how long an actor whose call failed gets no new chunk (`pick_actor`)
RESTART_WAITS = 240  # x 0.5 s: how long a restarting actor (a model load) is waited for
MAX_RESTARTS = 3  # of one replica (Ray's for an actor, the pool's for a tensor-parallel one)


@dataclass
class Chunk:
    """Trajectory indices of one problem, sent to an actor in one call."""

    problem: Problem
    indices: list[int]
    attempts: int = 0
    waits: int = 0  # resubmissions while its actor was restarting


@dataclass
class ProblemState:
    problem: Problem
    records: dict[int, dict] = field(default_factory=dict)  # index -> trajectory record
    stopped_early: bool = False
    reported: bool = False
    result: dict | None = None  # the vote and stats, set by the job when reported

    def answers(self) -> list[str | None]:
        return [
            extract_answer(self.records[i]["text"], self.problem.task) for i in sorted(self.records)
        ]


class ResultsFile:
    """Append-only JSONL of finished records, the resume point of a job: trajectories keyed by
    their int `index`, or (jobs.evaluate) graded items keyed by their str `id`."""

    def __init__(self, path: Path, key: str = "index", key_type: type = int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.key = key
        self.key_type = key_type

    def load(self) -> list[dict]:
        """Every complete record. A last line cut by a crash is dropped from the file too, so
        the next append starts on a fresh line; its work is simply redone."""
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
            self.path.write_text(text, encoding="utf-8")
        rows = []
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get(self.key), self.key_type):
                rows.append(row)
        return rows

    def append(self, record: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def stop_early(cfg: JobConfig, state: ProblemState) -> None:
    """Mark `state` stopped once no outcome of its missing trajectories can change the winner
    (`early_stop`, `aggregate.early_stop`: its calls in flight are then cancelled, and what
    they finished meanwhile is still recorded)."""
    if not cfg.early_stop or state.stopped_early or len(state.records) == cfg.n:
        return
    answers = dict(zip(sorted(state.records), state.answers(), strict=True))
    if decided_vote(answers, cfg.n, state.problem.task) is not None:
        state.stopped_early = True


def still_to_run(
    cfg: JobConfig, problems: list[Problem], records: list[dict]
) -> tuple[dict[str, ProblemState], list[Chunk]]:
    """What a run has left, from the `records` earlier runs finished (the results file): each
    problem's state, early stop applied, and its missing indices in chunks of `batch` (none
    once all n are in or the vote is decided). The pool runs the chunks; a job with none left
    needs no actor at all."""
    states = {p.id: ProblemState(p) for p in problems}
    for rec in records:  # resume: finished work is never redone
        state = states.get(rec.get("problem_id"))
        if state is not None and 0 <= rec["index"] < cfg.n:
            state.records.setdefault(rec["index"], rec)
    chunks = []
    for p in problems:
        stop_early(cfg, states[p.id])
        if states[p.id].stopped_early:
            continue
        todo = [i for i in range(cfg.n) if i not in states[p.id].records]
        size = chunk_size(cfg)
        chunks += [Chunk(p, todo[k : k + size]) for k in range(0, len(todo), size)]
    return states, chunks


def chunk_size(cfg: JobConfig) -> int:
    """Trajectories per call: `batch`, or with `early_stop` one (the pool decides a problem's
    vote as each trajectory returns, and cancels the rest in flight)."""
    return 1 if cfg.early_stop else cfg.batch


def calls_per_actor(cfg: JobConfig) -> int:
    """Calls kept in flight per actor: enough chunks (`chunk_size`) for its `max_rows` rows and
    half as many again waiting, so that a freed row is refilled at once, not after a round
    trip to the driver (an actor runs that many calls concurrently)."""
    rows, size = cfg.max_rows or default_max_rows("cpu"), chunk_size(cfg)
    return -(-rows // size) + -(-rows // (2 * size))


def pick_actor(
    chunk: Chunk,
    in_flight: Iterable[tuple[Chunk, int]],
    actors: int,
    room: int,
    shared: bool,
    turn: int,
    avoid: Container[int] = (),
) -> int:
    """The actor for `chunk`, given the calls in flight ((chunk, actor) each) and `room` calls
    an actor may hold. With a store every actor reads (`store.url`), or for a retried or
    waiting chunk, the round robin (a retry goes to another actor than the one that failed it).
    Otherwise a problem's chunks stay on the actor that runs its others (they learn from each
    other through its in-process store) while every actor has work; an idle actor, or no room
    there, spreads them to the least loaded one. Actors in `avoid` (a call failed there
    lately: a dead actor looks idle) get none while another can."""
    if shared or chunk.attempts or chunk.waits:
        return (turn + chunk.attempts) % actors
    usable = [i for i in range(actors) if i not in avoid] or list(range(actors))
    load, mine = [0] * actors, [0] * actors
    for other, index in in_flight:
        load[index] += 1
        mine[index] += other.problem.id == chunk.problem.id
    home = max(usable, key=lambda i: (mine[i], -load[i]))
    if min(load[i] for i in usable) > 0 and mine[home] and load[home] < room:
        return home
    return min(usable, key=lambda i: (load[i], (i - turn) % actors))


def start_actors(
    cfg: JobConfig,
    num: int,
    store_url: str | None,
    gpus_per_replica: int = 0,
    strategies: list | None = None,
) -> list:
    """Start `num` generator actors and wait until every model is loaded."""
    remote = ray.remote(concurrency_groups={"control": 1})(GeneratorActor)  # beside the runs
    actors = []
    for i in range(num):
        opts = {
            "num_cpus": cfg.cpus_per_replica,
            "num_gpus": gpus_per_replica,
            "max_restarts": MAX_RESTARTS,
            "max_task_retries": 0,
            "max_concurrency": calls_per_actor(cfg),
        }
        if strategies:
            opts["scheduling_strategy"] = strategies[i]
        actors.append(remote.options(**opts).remote(cfg, store_url))
    ray.get([a.ready.remote() for a in actors])
    return actors


def start_replicas(
    cfg: JobConfig, num: int, store_url: str | None, gpus_per_rank: int | None = None
) -> list[TensorParallelReplica]:
    """Start `num` tensor-parallel replicas of `cfg.tensor_parallel` ranks, each in its own
    STRICT_PACK group of `cpus_per_replica` CPUs and `gpus_per_rank` GPUs (default: one on
    CUDA) per rank, every shard loaded."""
    return [
        TensorParallelReplica(
            cfg.model,
            cfg.tensor_parallel,
            cfg.cpus_per_replica,
            cfg.placement_timeout_s,
            job=cfg,
            store_url=store_url,
            max_concurrency=calls_per_actor(cfg),
            gpus_per_rank=gpus_per_rank,
        )
        for _ in range(num)
    ]


def close_actors(actors: list) -> dict[str, float]:
    """Close every actor's stores (their final flush, a bounded wait), before the actors go
    with the job; a tensor-parallel replica closes its ranks and group too. An actor that died
    took its queued writes with it: logged, not raised, as every trajectory is already
    written. Returns the actors' store counters, summed (`actors.generator.add_store`)."""
    refs = [a.close.remote() for a in actors if not isinstance(a, TensorParallelReplica)]
    totals: dict[str, float] = {}
    for ref in refs:
        try:
            add_store(totals, ray.get(ref) or {})
        except RayError as e:
            log.warning("an actor could not close its stores: %s", e)
    for replica in actors:
        if isinstance(replica, TensorParallelReplica):
            try:
                replica.close()
            except RayError as e:
                log.warning("a tensor-parallel replica could not close: %s", e)
    return totals


def kill_replicas(actors: list) -> None:
    """Kill every tensor-parallel replica's ranks and group (a job that failed)."""
    for replica in actors:
        if isinstance(replica, TensorParallelReplica):
            replica.kill()


def _leader(actor):
    """The actor handle the pool calls: rank 0 of a tensor-parallel replica."""
    return actor.leader if isinstance(actor, TensorParallelReplica) else actor


def _rank_failed(err: RayError) -> bool:
    """Did a tensor-parallel call fail with its replica (a rank died, a collective broke), not
    with its own request (too long a prompt)?"""
    from tts_service.generation import InputTooLongError  # the engine, on a failure only

    return not (isinstance(err, RayTaskError) and isinstance(err.cause, InputTooLongError))


class TrajectoryPool:
    """`actors`: generator actor handles or `TensorParallelReplica`s."""

    def __init__(self, cfg: JobConfig, actors: list, job_id: str, results: ResultsFile) -> None:
        if not actors:
            raise ValueError("the pool needs at least one actor")
        self.cfg = cfg
        self.actors = actors
        self.job_id = job_id
        self.results = results
        self.retries = 0
        self.failed_at: dict[int, float] = {}  # actor index -> when a call of it last failed

    def run(
        self,
        problems: list[Problem],
        on_trajectory: Callable[[dict], None] | None = None,
        on_problem: Callable[[ProblemState], None] | None = None,
    ) -> dict[str, ProblemState]:
        """Run every missing trajectory; returns each problem's state when all are done."""
        states, chunks = still_to_run(self.cfg, problems, self.results.load())
        queue = deque(chunks)
        in_flight: dict = {}  # ref -> (chunk, index of its actor)
        watch = self._follower_loops()

        def report_if_done(state: ProblemState) -> None:
            busy = any(c.problem.id == state.problem.id for c, _ in in_flight.values())
            finished = len(state.records) == self.cfg.n or (state.stopped_early and not busy)
            if finished and not state.reported:
                state.reported = True
                if on_problem is not None:
                    on_problem(state)

        for state in states.values():
            report_if_done(state)
        turn = 0
        while queue or in_flight:
            turn = self._submit(queue, in_flight, states, turn, report_if_done)
            if not in_flight:
                continue
            done, _ = ray.wait([*in_flight, *watch], num_returns=1)
            if done[0] in watch:
                self._restart(watch[done[0]], [], in_flight, watch, queue, "a rank died")
                continue
            chunk, index = in_flight.pop(done[0])
            records = self._result(done[0], chunk, index, in_flight, watch, queue)
            if records is None:
                continue
            state = states[chunk.problem.id]
            self._record(state, records, on_trajectory)
            if not state.stopped_early:
                stop_early(self.cfg, state)
                if state.stopped_early:
                    self._cancel(state.problem.id, in_flight)
            report_if_done(state)
        return states

    def _cancel(self, problem_id: str, in_flight: dict) -> None:
        """Stop the decided problem's rows in flight on every actor that has some (a
        tensor-parallel replica's finish: its rank 0 answers no call beside its runs)."""
        holding = {i for chunk, i in in_flight.values() if chunk.problem.id == problem_id}
        for i in holding:
            if not isinstance(self.actors[i], TensorParallelReplica):
                self.actors[i].cancel.remote(self.job_id, problem_id)

    def _follower_loops(self) -> dict:
        """A follower's loop, which ends only when a rank dies -> index of its actor."""
        return {
            ref: i
            for i, a in enumerate(self.actors)
            if isinstance(a, TensorParallelReplica)
            for ref in a.following
        }

    def _submit(
        self,
        queue: deque,
        in_flight: dict,
        states: dict[str, ProblemState],
        turn: int,
        report_if_done: Callable[[ProblemState], None],
    ) -> int:
        """Send queued chunks until every actor has `calls_per_actor` calls in flight (a chunk
        of a problem that stopped early is dropped, and the problem reported if done); returns
        the next `turn` of the round robin (`pick_actor` chooses the actor)."""
        room, shared = calls_per_actor(self.cfg), self.cfg.store.url is not None
        now = time.monotonic()
        avoid = {i for i, at in self.failed_at.items() if now - at < AVOID_S}
        while queue and len(in_flight) < room * len(self.actors):
            chunk = queue.popleft()
            if states[chunk.problem.id].stopped_early:
                report_if_done(states[chunk.problem.id])
                continue
            n = len(self.actors)
            index = pick_actor(chunk, in_flight.values(), n, room, shared, turn, avoid)
            turn += 1
            ref = _leader(self.actors[index]).run.remote(
                self.job_id,
                chunk.problem.id,
                chunk.problem.question,
                chunk.indices,
                chunk.attempts,
                self.cfg,
            )
            in_flight[ref] = (chunk, index)
        return turn

    def _result(
        self, ref, chunk: Chunk, index: int, in_flight: dict, watch: dict, queue: deque
    ) -> list[dict] | None:
        """The records of actor `index`'s finished call `ref` for `chunk`, or None if it failed:
        then the chunk is retried, or its tensor-parallel replica restarted."""
        try:
            return ray.get(ref)
        except RayError as e:  # actor died, worker crashed, object lost, OOM-killed
            self.failed_at[index] = time.monotonic()
            if isinstance(self.actors[index], TensorParallelReplica) and _rank_failed(e):
                self._restart(index, [chunk], in_flight, watch, queue, e)
            else:
                self._retry(chunk, queue, e)
            return None

    def _record(
        self,
        state: ProblemState,
        records: list[dict],
        on_trajectory: Callable[[dict], None] | None,
    ) -> None:
        """Keep and append each new record of `state`'s problem (a retried call's duplicates
        are dropped)."""
        for rec in records:
            if rec["index"] in state.records:  # a duplicate from a retried call
                continue
            state.records[rec["index"]] = rec
            self.results.append(rec)
            if on_trajectory is not None:
                on_trajectory(rec)

    def _restart(
        self,
        index: int,
        lost: list[Chunk],
        in_flight: dict,
        watch: dict,
        queue: deque,
        err: Exception | str,
    ) -> None:
        """Restart tensor-parallel replica `index` as a whole and resubmit `lost` and every
        other chunk it had in flight (each a failed attempt)."""
        replica = self.actors[index]
        for ref, (chunk, i) in list(in_flight.items()):
            if i == index:
                lost.append(chunk)
                del in_flight[ref]
        for ref, i in list(watch.items()):
            if i == index:
                del watch[ref]
        if replica.restarts >= MAX_RESTARTS:
            raise RuntimeError(
                f"tensor-parallel replica {index} failed {replica.restarts + 1} times; "
                f"last error: {err}"
            )
        log.warning("tensor-parallel replica %d: %s; restarting it", index, err)
        replica.restart()
        watch.update({ref: index for ref in replica.following})
        for chunk in lost:
            self.retries += 1
            self._resubmit(chunk, queue, err)

    def _retry(self, chunk: Chunk, queue: deque, err: Exception) -> None:
        self.retries += 1
        if isinstance(err, ActorUnavailableError) and chunk.waits < RESTART_WAITS:
            # the actor is restarting (Ray reruns its constructor): not a failed attempt
            chunk.waits += 1
            time.sleep(0.5)
            queue.appendleft(chunk)
            return
        self._resubmit(chunk, queue, err)

    def _resubmit(self, chunk: Chunk, queue: deque, err: Exception | str) -> None:
        """A failed attempt: back to the queue's front, to go to another actor, unless
        `max_retries` are spent."""
        chunk.attempts += 1
        if chunk.attempts > self.cfg.max_retries:
            raise RuntimeError(
                f"problem {chunk.problem.id}: trajectories {chunk.indices} failed "
                f"{chunk.attempts} times; last error: {err}"
            ) from err
        log.warning(
            "problem %s, trajectories %s: %s; retrying",
            chunk.problem.id,
            chunk.indices,
            err if isinstance(err, str) else type(err).__name__,
        )
        queue.appendleft(chunk)
