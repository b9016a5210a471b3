"""Where the pool sends a problem's chunks (`actors.pool.pick_actor`): together on one actor
while every actor has work (they learn from each other through its in-process store), spread
when an actor would idle, and round robin over a shared store."""

from __future__ import annotations

from actors.pool import Chunk, pick_actor
from tts_service.schemas import Problem


def _chunks(problem: str, count: int) -> list[Chunk]:
    p = Problem(id=problem, question="q")
    return [Chunk(p, [4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3]) for k in range(count)]


def _place(chunks: list[Chunk], actors: int, room: int, shared: bool) -> list[int]:
    in_flight: list[tuple[Chunk, int]] = []
    for turn, chunk in enumerate(chunks):
        in_flight.append((chunk, pick_actor(chunk, in_flight, actors, room, shared, turn)))
    return [index for _, index in in_flight]


def test_a_problem_s_chunks_stay_together_once_every_actor_has_work():
    placed = _place(_chunks("a", 4) + _chunks("b", 4), actors=2, room=5, shared=False)
    assert placed[:2] == [0, 1]  # an idle actor gets work first
    assert placed[2:4] == [0, 0]  # then with the actor that runs most of them
    assert placed[4:] == [1, 1, 1, 1]  # b on the other actor, together
    # an actor without room spreads the rest to the least loaded one
    assert _place(_chunks("a", 5), actors=2, room=2, shared=False) == [0, 1, 0, 1, 0]


def test_over_a_shared_store_and_for_a_retry_the_round_robin_spreads_them():
    assert _place(_chunks("a", 4), actors=2, room=5, shared=True) == [0, 1, 0, 1]
    retry = _chunks("a", 1)[0]
    retry.attempts = 1
    assert pick_actor(retry, [], 3, 5, False, 0) == 1  # another actor than the one that failed


def test_a_job_sums_its_actors_store_counters():
    """`add_store`: replication counters summed over closed stores and actors, the lag's worst
    p99 kept; an in-process store's stats add nothing; the job's line says it."""
    from actors.generator import add_store
    from jobs.actor_set import store_line

    totals: dict[str, float] = {}
    add_store(totals, {"remote_updates": 10, "flushed_updates": 12, "lag_ms_p99": 30.0})
    add_store(totals, {"entries": 5, "misses": 2})  # in-process
    add_store(totals, {"remote_updates": 5, "lost_updates": 1, "lag_ms_p99": 12.5})
    assert totals == {
        "remote_updates": 15,
        "flushed_updates": 12,
        "lost_updates": 1,
        "lag_ms_p99": 30.0,
    }
    line = store_line(totals, 2)
    assert "2 actor(s)" in line and "15 merged" in line and "lag p99 30 ms" in line


def test_an_actor_whose_call_failed_lately_gets_no_new_chunk():
    """A dead actor's calls have all failed, so it looks idle: it must not draw every new
    chunk (each would wait out its restart) while another actor can take them."""
    chunks = _chunks("a", 3)
    in_flight: list[tuple[Chunk, int]] = []
    for turn, chunk in enumerate(chunks):
        index = pick_actor(chunk, in_flight, 2, 5, False, turn, avoid={0})
        in_flight.append((chunk, index))
    assert [i for _, i in in_flight] == [1, 1, 1]
    assert pick_actor(chunks[0], [], 2, 5, False, 0, avoid={0, 1}) == 0  # none usable: any
