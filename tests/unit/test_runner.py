"""The one trajectory runner: continuous batching stays lossless, and the metrics describe what
really happened."""

from __future__ import annotations

import time

import pytest
import torch

from store.memory import InMemoryNgramStore
from tests.conftest import COPYING_KINDS, DRAFTER_CONFIGS, word_tokenizer
from tests.unit.engine.test_allocate import FLAT
from tts_service.config import SamplingConfig
from tts_service.engine.allocate import DraftCost
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.cost import BatchCost
from tts_service.engine.decode import plain_generate
from tts_service.generation import Generator
from tts_service.models import LoadedModel
from tts_service.runner import TrajectoryRunner
from tts_service.solve import ProblemInput, solve_problems
from tts_service.trajectory import TrajectoryRequest, trajectory_requests

VOCAB = 64


def make_generator(model, batch_cost: BatchCost | None = FLAT) -> Generator:
    from tests.conftest import FLAT_COST
    from tts_service.engine.cost import CostModel

    loaded = LoadedModel(model, word_tokenizer(VOCAB), (), model.device, model.dtype, "tiny")
    return Generator(loaded, cost=CostModel.fixed(FLAT_COST), batch_cost=batch_cost)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 5, 4, 2, 6)]
    return [base[0] * 4, base[1] + base[2], base[3] * 3, [7], base[4] * 2]


def run_three_problems(
    model, monkeypatch, cfg, temperature: float, kernel: tuple[type, str], member: type | None
) -> tuple[list[list], dict, list[dict], int]:
    """3 problems x 3 trajectories of different lengths on 4 rows (rows join and leave), each
    problem over its own in-process store, as the compiled drafters' tests run them compiled
    and not: every step's trees, every trajectory's tokens, the stores' stats, and how often
    the group's drafting method `kernel` (class, name) was called. `member`: a compiled row's
    class whose group is hidden (each row drafts alone, as under a wrapper), or None."""
    drafted: list[list] = []
    draft = BatchDecoder._draft

    def record(self, batch, max_nodes, fill):
        trees = draft(self, batch, max_nodes, fill)
        drafted.append(trees)
        return trees

    monkeypatch.setattr(BatchDecoder, "_draft", record)
    calls = []
    group, name = kernel
    group_draft = getattr(group, name)
    monkeypatch.setattr(group, name, lambda self, *a: calls.append(1) or group_draft(self, *a))
    if member is not None:
        monkeypatch.setattr(member, "grouped", lambda self: None)
    requests, stores = [], []
    for p, prompt in enumerate(_prompts()[:3]):
        stores.append(InMemoryNgramStore())
        for i in range(3):
            sampling = SamplingConfig(
                temperature=temperature, max_new_tokens=10 + 6 * ((p + i) % 3), seed=i
            )
            requests.append(TrajectoryRequest(f"p{p}", i, prompt, sampling, cfg, stores[-1]))
    report = TrajectoryRunner(make_generator(model), 4).run(requests)
    tokens = {(r.request.problem_id, r.request.index): r.output.token_ids for r in report.results}
    return drafted, tokens, [s.stats() for s in stores], len(calls)


def _compiled_cases() -> dict[str, tuple]:
    """Each compiled drafter: (its config at `compiled`, `sizing`; its group's drafting method;
    its row class; whether its children are drawn under sampling)."""
    from tts_service.drafters.stand_compiled import CompiledStand, StandGroup
    from tts_service.drafters.stand_config import StandDrafterConfig
    from tts_service.drafters.stand_dyn_compiled import CompiledStandDyn, StandDynGroup
    from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig

    return {
        "stand": (
            lambda compiled, sizing: StandDrafterConfig(
                tree="stand-625", num_nodes=16, sizing=sizing, compiled=compiled
            ),
            (StandGroup, "draft"),
            CompiledStand,
            True,
        ),
        "stand-dyn": (
            lambda compiled, sizing: StandDynDrafterConfig(
                num_nodes=12, sizing=sizing, compiled=compiled
            ),
            (StandDynGroup, "draft_all"),
            CompiledStandDyn,
            False,
        ),
        "stand-dyn-drawn": (
            lambda compiled, sizing: StandDynDrafterConfig(
                num_nodes=12, sizing=sizing, compiled=compiled, drawn=True, noise_buffer=130
            ),  # the least noise a buffer may hold for 12 nodes: it refills every step or two
            (StandDynGroup, "draft_all"),
            CompiledStandDyn,
            True,
        ),
    }


@pytest.mark.parametrize("method", ["stand", "stand-dyn", "stand-dyn-drawn"])
@pytest.mark.parametrize(
    ("temperature", "sizing", "grouped"),
    [(0.0, "fixed", True), (1.0, "fixed", True), (1.0, "gt", True), (1.0, "fixed", False)],
)
def test_compiled_trees_equal_the_python_drafters(
    tiny_model, monkeypatch, method, temperature, sizing, grouped
):
    """A compiled drafter (one kernel call a step for a problem's rows) drafts the Python
    drafter's trees through the runner, rows joining and leaving; `grouped=False`: each
    compiled row drafts alone (as under a wrapper that hides its group), one call per row."""
    config, kernel, member, draws = _compiled_cases()[method]
    python = run_three_problems(
        tiny_model, monkeypatch, config(False, sizing), temperature, kernel, None
    )
    monkeypatch.undo()
    compiled = run_three_problems(
        tiny_model,
        monkeypatch,
        config(True, sizing),
        temperature,
        kernel,
        None if grouped else member,
    )
    assert python[3] == 0 and compiled[3] > 0  # the kernel drafted, one call a step for all rows
    assert len(compiled[0]) == len(python[0]) > 10
    assert compiled[0] == python[0]  # every step's trees: tokens, parents, drawn flags, q
    assert compiled[1] == python[1]
    assert compiled[2] == python[2]  # the stores' entries and lookup counts
    drafted = [t for step in compiled[0] for t in step if t.size > 1]
    assert len(drafted) > 10  # trees were drafted
    assert any(t.sampled[1] for t in drafted) == (draws and temperature > 0)


@pytest.mark.parametrize("max_rows", [1, 3])
def test_a_continuously_batched_run_is_token_identical_to_plain(
    tiny_model, drafter_config, max_rows
):
    """Five problems of mixed prompt lengths, two trajectories each, different lengths: rows
    join and leave at different steps; each equals plain greedy decoding alone."""
    gen = make_generator(tiny_model)
    prompts = _prompts()
    requests, refs = [], []
    for p, prompt in enumerate(prompts):
        store = InMemoryNgramStore()
        for i in range(2):
            cfg = SamplingConfig(temperature=0, max_new_tokens=6 + 7 * ((p + i) % 4), seed=i)
            requests.append(TrajectoryRequest(f"p{p}", i, prompt, cfg, drafter_config, store))
            refs.append(plain_generate(tiny_model, prompt, cfg, eos_ids=[]).token_ids)
    report = TrajectoryRunner(gen, max_rows).run(requests)
    by_key = {(r.request.problem_id, r.request.index): r.output for r in report.results}
    for req, ref in zip(requests, refs, strict=True):
        assert by_key[req.problem_id, req.index].token_ids == ref, (req.problem_id, req.index)
    if max_rows > 1:
        assert 1 < report.forwards.mean_rows_per_forward <= max_rows
        joined_late = sum(1 for rows, _ in report.forwards.trace if rows < max_rows)
        assert joined_late < len(report.forwards.trace)  # most steps ran full
    if drafter_config.kind not in ("plain", "ptd"):  # a new family: some draft accepted
        bar = 1.2 if drafter_config.kind in COPYING_KINDS else 1.0
        assert report.summary()["acceptance_length"] > bar


@pytest.mark.parametrize("method", ["stand-dyn", "gtcp"])
@pytest.mark.parametrize("explores", [False, True])
def test_an_exploring_step_drafts_the_size_it_explores(tiny_model, monkeypatch, explores, method):
    """Where a row's verify cost says no node pays, a GT-sized drafter sends its root alone;
    on a step the planner explores, it sends the planned nodes (`DraftContext.fill`), so the
    surface times the shape explored. Else a surface that overprices trees would explore
    width-1 steps only and never learn otherwise."""
    from tts_service.engine.allocate import SpeculationPlanner
    from tts_service.engine.cost import CostModel, VerifyCost

    def plan(self, context, stats, per_node=0.0):
        self.last_explored = explores
        return 8

    monkeypatch.setattr(SpeculationPlanner, "plan", plan)
    steep = VerifyCost((1, 2, 128), (1.0, 100.0, 200.0), 256)  # no draft node ever pays
    loaded = LoadedModel(
        tiny_model, word_tokenizer(VOCAB), (), tiny_model.device, tiny_model.dtype, "tiny"
    )
    gen = Generator(loaded, cost=CostModel.fixed(steep), batch_cost=FLAT)
    store, prompt = InMemoryNgramStore(), _prompts()[0]  # repetitive: candidates at once
    cfg = SamplingConfig(temperature=0, max_new_tokens=12)
    requests = [
        TrajectoryRequest("p", i, prompt, cfg, DRAFTER_CONFIGS[method], store) for i in range(2)
    ]
    report = TrajectoryRunner(gen, 2).run(requests)
    widths = {width for _, width in report.forwards.trace}
    assert (max(widths) > 1) == explores, widths
    ref = plain_generate(tiny_model, prompt, cfg, eos_ids=[]).token_ids
    assert all(r.output.token_ids == ref for r in report.results)


def test_greedy_rows_beside_sampled_rows_stay_plain_greedy(tiny_model):
    """Greedy and sampled rows of one problem decode in the same forwards, drafting trees
    (drawn children on the sampled rows): each greedy row equals plain greedy decoding alone
    (acceptance picks each row's rule, whatever its neighbours')."""
    gen = make_generator(tiny_model)
    prompt = _prompts()[0]
    drafter = DRAFTER_CONFIGS["stand-dyn"].model_copy(update={"drawn": True})

    def request(i: int, store: InMemoryNgramStore) -> TrajectoryRequest:
        cfg = SamplingConfig(temperature=0 if i % 2 else 0.8, max_new_tokens=16, seed=i)
        return TrajectoryRequest("p", i, prompt, cfg, drafter, store)

    store = InMemoryNgramStore()
    report = TrajectoryRunner(gen, 4).run([request(i, store) for i in range(4)])
    assert report.forwards.trace[0][0] == 4 and report.summary()["acceptance_length"] > 1.0
    greedy = [r for r in report.results if r.request.sampling.temperature == 0]
    assert len(greedy) == 2 and all(len(r.output.token_ids) == 16 for r in report.results)
    for r in greedy:
        ref = plain_generate(tiny_model, prompt, r.request.sampling, eos_ids=[]).token_ids
        assert r.output.token_ids == ref, r.request.index


@pytest.mark.statistical
def test_a_row_that_joined_a_running_batch_samples_exactly():
    """The sampled rows join a batch whose first row is still running (its prompt is
    different and long); their first two tokens follow the exact distribution."""
    from tests.conftest import tiny_llama
    from tests.integration.test_entry_sampling import pvalue
    from tts_service.engine.sampling import target_probs

    vocab = 12
    model = tiny_llama(vocab_size=vocab, seed=11, scale=6.0)
    loaded = LoadedModel(model, word_tokenizer(vocab), (), model.device, model.dtype, "tiny")
    gen = Generator(loaded, batch_cost=FLAT)
    prompt = [3, 7, 1, 3, 7, 1, 3, 7]
    cfg = SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=2)
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:], cfg)[0]
        p2 = target_probs(
            model(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1], cfg
        )
    exact = {(a, b): float(p1[a] * p2[a, b]) for a in range(vocab) for b in range(vocab)}
    stand = DRAFTER_CONFIGS["stand"]
    samples, runner = [], TrajectoryRunner(gen, max_rows=3)
    for k in range(300):
        store = InMemoryNgramStore()
        long = SamplingConfig(temperature=0.9, max_new_tokens=12, seed=10_000 + k)
        reqs = [TrajectoryRequest("long", 0, [5, 2, 9, 4], long, stand, store)]
        reqs += [
            TrajectoryRequest(
                "q", i, prompt, cfg.model_copy(update={"seed": 4 * k + i}), stand, store
            )
            for i in range(4)
        ]
        report = runner.run(reqs)
        joined = [r for r in report.results if r.request.problem_id == "q"]
        samples += [r.output.token_ids for r in joined]
        assert report.forwards.trace[0][0] == 3  # the long row and two sampled rows
    assert pvalue(samples, exact) > 1e-3


def test_batched_metrics_match_the_stopwatch(tiny_model):
    gen = make_generator(tiny_model)
    problems = [ProblemInput(f"p{i}", p, InMemoryNgramStore()) for i, p in enumerate(_prompts())]
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=40)
    t0 = time.perf_counter()
    run = solve_problems(TrajectoryRunner(gen, 4), problems, 3, DRAFTER_CONFIGS["stand"], sampling)
    measured = time.perf_counter() - t0
    stats = run.stats()
    assert abs(stats["wall_s"] - measured) <= 0.1 * measured
    tokens = sum(len(t.output.token_ids) for p in run.problems for t in p.trajectories)
    assert (
        stats["new_tokens"]
        == tokens
        == sum(t.output.stats.new_tokens for p in run.problems for t in p.trajectories)
    )
    assert stats["target_forwards"] == run.report.forwards.forwards
    assert stats["target_forwards"] < stats["row_forwards"]  # rows shared forwards
    assert stats["tokens_per_s"] == pytest.approx(tokens / stats["wall_s"], rel=1e-3)


def test_auto_at_many_rows_on_a_steep_surface_is_plain_decoding(tiny_model, monkeypatch):
    """Where trees do not pay, `auto`'s steps are plain steps: no drafter is asked for a tree,
    every forward is one token per row, the tokens are plain decoding's, and the store still
    learns from every step (at the cost bench/auto_speed.py shows)."""
    from tests.unit.engine.test_allocate import STEEP
    from tts_service.drafters.stand_dyn import StandDynDrafter
    from tts_service.drafters.stand_dyn_config import StandDynDrafterConfig

    calls = []
    draft = StandDynDrafter.draft
    monkeypatch.setattr(
        StandDynDrafter, "draft", lambda self, ctx: calls.append(ctx) or draft(self, ctx)
    )
    gen = make_generator(tiny_model, batch_cost=STEEP)
    store = InMemoryNgramStore()
    prompt = _prompts()[0]
    requests = [
        TrajectoryRequest(
            "p",
            i,
            prompt,
            SamplingConfig(temperature=0, max_new_tokens=12, seed=i),
            StandDynDrafterConfig(),
            store,
        )
        for i in range(16)
    ]
    report = TrajectoryRunner(gen, 16).run(requests)
    assert calls == []
    assert {width for _, width in report.forwards.trace} == {1}
    ref = plain_generate(tiny_model, prompt, requests[0].sampling, eos_ids=[]).token_ids
    assert all(r.output.token_ids == ref for r in report.results)
    assert store.lookup(list(ref[:-1])) is not None  # the root distributions were stored
    spec = report.summary()["speculation"]
    assert spec["steps"] == 12 and spec["drafted_steps"] == 0 == spec["explored_steps"]
    assert spec["cost_surface"] == "fixed"


def _loaded(model) -> LoadedModel:
    return LoadedModel(model, word_tokenizer(VOCAB), (), model.device, model.dtype, "tiny")


def _stand_requests(n: int) -> list[TrajectoryRequest]:
    """`n` greedy STAND trajectories of one prompt, sharing a store."""
    store = InMemoryNgramStore()
    sampling = [SamplingConfig(temperature=0, max_new_tokens=10, seed=i) for i in range(n)]
    return [
        TrajectoryRequest("p", i, _prompts()[1], s, DRAFTER_CONFIGS["stand"], store)
        for i, s in enumerate(sampling)
    ]


def test_the_learned_surface_is_opened_once_and_taught_by_every_step(tiny_model, tmp_path):
    """No measurement at load: the runner's first drafting step opens the surface (a prior
    from four timed forwards), every step teaches it, and the next generator reads it back."""
    loaded = _loaded(tiny_model)
    gen = Generator(loaded, cost_cache=tmp_path)
    report = TrajectoryRunner(gen, 3).run(_stand_requests(3))
    surface = gen.surface()
    assert surface.source == "prior" and surface.steps == report.forwards.forwards
    assert report.summary()["speculation"]["cost_surface"] == "prior"
    again = Generator(loaded, cost_cache=tmp_path).surface()
    assert again.source == "disk" and set(again.buckets) == set(surface.buckets)


def test_a_step_that_is_not_steady_does_not_teach_the_surface(tiny_model):
    """On a GPU the step that captures a bucket's graph also runs two warm-up forwards and the
    capture: not that bucket's cost. Stood in for here (no GPU) by a decoder that reports
    every other step unsteady: the surface learns from the others only."""

    class EagerEveryOtherStep(BatchDecoder):
        @property
        def last_step_steady(self) -> bool:
            return self.forwards.forwards % 2 == 0

    gen = Generator(_loaded(tiny_model))
    decoder = EagerEveryOtherStep(tiny_model, ())
    report = TrajectoryRunner(gen, 3, decoder=decoder).run(_stand_requests(3))
    forwards = report.forwards.forwards
    assert forwards >= 4 and gen.surface().steps == forwards // 2


def test_draft_cost_is_a_decayed_mean_per_planned_node():
    cost = DraftCost()
    cost.record(1.0, 10)
    assert cost.per_node == pytest.approx(0.1)  # the first step sets it
    cost.record(2.0, 10)
    assert cost.per_node == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))
    cost.record(5.0, 0)  # a plain step prices nothing
    assert cost.steps == 2


def test_a_rows_first_tree_step_does_not_price_drafting(tiny_model):
    """The planner prices k nodes per row at `draft_cost.per_node` × rows × k, learned from
    every tree step but those where a row's drafter catches up (at its first tree step it
    indexes the whole prompt: one-time, and on a GPU it priced every later tree out; after
    plain steps, what they committed). 3 rows through 2, every step a tree step: the first
    step and the step the third row joins are left out, and every sample is the step's
    planned nodes (rows × nodes per row), not the nodes the drafters sent."""
    runner = TrajectoryRunner(make_generator(tiny_model), 2, "fixed", token_budget=10)
    planned: list[int] = []
    record = runner.draft_cost.record
    runner.draft_cost.record = lambda s, n: planned.append(n) or record(s, n)  # type: ignore[method-assign]
    report = runner.run(_stand_requests(3))
    assert len(planned) == report.forwards.forwards - 2
    assert set(planned) <= {2 * 4, 1 * 9}  # nodes_per_row(10, 2) = 4, (10, 1) = 9
    assert runner.draft_cost.per_node > 0


def test_a_prompt_is_prefilled_once_however_its_rows_join(tiny_model, monkeypatch):
    """Best-of-N: rows of one prompt that join at different steps (2 rows, 5 trajectories
    each of two problems) take its KV from the prompt cache; every row still equals plain."""
    from tts_service.engine.prefill import PrefillJob

    prefilled: list[tuple[int, ...]] = []
    job = PrefillJob.of
    monkeypatch.setattr(
        PrefillJob, "of", classmethod(lambda cls, ps, *rest: prefilled.extend(ps) or job(ps, *rest))
    )
    gen = make_generator(tiny_model)
    prompts = _prompts()[:2]
    requests = [
        TrajectoryRequest(
            f"p{p}",
            i,
            prompt,
            SamplingConfig(temperature=0, max_new_tokens=3 + 4 * i, seed=i),
            DRAFTER_CONFIGS["stand"],
            InMemoryNgramStore(),
        )
        for p, prompt in enumerate(prompts)
        for i in range(5)
    ]
    report = TrajectoryRunner(gen, 2).run(requests)
    assert sorted(prefilled) == sorted(tuple(p[:-1]) for p in prompts)
    for res in report.results:
        ref = plain_generate(tiny_model, res.request.prompt_ids, res.request.sampling, eos_ids=[])
        assert res.output.token_ids == ref.token_ids


def test_more_new_prompts_in_one_join_than_the_prompt_cache_keeps(tiny_model):
    """12 distinct prompts join one batch at once, past the prompt cache's 8: every row still
    equals plain (the cache evicting this join's own prompts made the join fail)."""
    gen = make_generator(tiny_model)
    requests = [
        TrajectoryRequest(
            "p",
            i,
            [1 + i, 2 + i, 3 + i, 4],
            SamplingConfig(temperature=0, max_new_tokens=4, seed=i),
            DRAFTER_CONFIGS["stand"],
            InMemoryNgramStore(),
        )
        for i in range(12)
    ]
    report = TrajectoryRunner(gen, 12).run(requests)
    assert len(report.results) == 12
    for res in report.results:
        ref = plain_generate(tiny_model, res.request.prompt_ids, res.request.sampling, eos_ids=[])
        assert res.output.token_ids == ref.token_ids


@pytest.mark.parametrize("phase", ["admit", "prefill"])
def test_a_join_that_fails_answers_its_own_requests(tiny_model, monkeypatch, phase):
    """Requests whose rows were joining when the engine failed (admitting them, or running a
    chunk of their prefill) are in neither the queue nor the batch: they must hear of the
    failure, not wait forever."""
    from tts_service.engine.batch import BatchDecoder
    from tts_service.runner import RunnerLoop

    def broken(self, *args):
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(BatchDecoder, phase, broken)
    loop = RunnerLoop(TrajectoryRunner(make_generator(tiny_model), 4))
    request = TrajectoryRequest(
        "p",
        0,
        [1, 2, 3],
        SamplingConfig(max_new_tokens=2),
        DRAFTER_CONFIGS["stand"],
        InMemoryNgramStore(),
    )
    with pytest.raises(RuntimeError, match="prefill failed"):
        loop.submit([request]).wait(timeout=60)


def test_a_failed_join_into_an_empty_batch_leaves_no_stale_cache_rows(tiny_model, monkeypatch):
    """A join that fails after appending its rows' KV to an empty batch: the next requests
    still decode exactly (stale rows below them would shift every row's cache)."""
    from tts_service.engine.batch import BatchDecoder
    from tts_service.engine.kv import StaticKV

    gen = make_generator(tiny_model)
    runner = TrajectoryRunner(gen, 4)
    append = StaticKV.append_rows
    calls = []

    def append_then_fail(self, *args, **kwargs):
        append(self, *args, **kwargs)
        if not calls:
            calls.append(1)
            raise RuntimeError("failed after appending")

    monkeypatch.setattr(StaticKV, "append_rows", append_then_fail)
    request = lambda i: TrajectoryRequest(  # noqa: E731
        "p",
        i,
        [1 + i, 2, 3],
        SamplingConfig(temperature=0, max_new_tokens=4),
        DRAFTER_CONFIGS["stand"],
        InMemoryNgramStore(),
    )
    with pytest.raises(RuntimeError, match="after appending"):
        runner.run([request(0)])
    assert isinstance(runner.decoder, BatchDecoder) and runner.decoder.cache.rows == 0
    report = runner.run([request(1), request(2)])
    for res in report.results:
        ref = plain_generate(tiny_model, res.request.prompt_ids, res.request.sampling, eos_ids=[])
        assert res.output.token_ids == ref.token_ids


def test_requests_with_equal_seeds_never_share_a_salted_stream():
    """What Serve does per request and a job per call: `trajectory_requests` with no nonce
    draws one, so equal explicit seeds (concurrent or repeated requests) get other uniforms;
    a pinned nonce gives the same ones again (what reproducing a run needs)."""
    cfg, store = DRAFTER_CONFIGS["stand"], InMemoryNgramStore()
    sampling = SamplingConfig(temperature=0.7, seed=3)
    keys = [
        r.params().salt
        for _ in range(2)
        for r in trajectory_requests("q", [1, 2], range(2), sampling, cfg, store)
    ]
    assert len(set(keys)) == 4
    pinned = sampling.model_copy(update={"run_nonce": 5})
    again = [
        [r.params().salt for r in trajectory_requests("q", [1, 2], range(2), pinned, cfg, store)]
        for _ in range(2)
    ]
    assert again[0] == again[1] and len(set(again[0])) == 2
    greedy = sampling.model_copy(update={"temperature": 0.0})
    assert {r.params().salt for r in trajectory_requests("q", [1], [0], greedy, cfg, store)} == {""}


def test_short_requests_finish_while_a_long_prompt_prefills(tiny_model):
    """A 300-token prompt submitted first, 16 tokens a chunk, then three short requests: they
    join and finish while its prefill runs a chunk between their steps; every trajectory still
    equals plain."""
    gen = make_generator(tiny_model)
    gen.prefill_chunk = 16
    runner = TrajectoryRunner(gen, 4)

    def request(i: int, prompt: list[int], n: int) -> TrajectoryRequest:
        sampling = SamplingConfig(temperature=0, max_new_tokens=n, seed=i)
        return TrajectoryRequest(
            "p", i, prompt, sampling, DRAFTER_CONFIGS["pld"], InMemoryNgramStore()
        )

    long_prompt = torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(9))
    long = runner.submit([request(0, long_prompt.tolist(), 4)])
    prompts = _prompts()[:3]
    finished_while_prefilling = []
    short = runner.submit(
        [request(1 + i, p, 6) for i, p in enumerate(prompts)],
        lambda res: finished_while_prefilling.append(bool(runner.decoder.joining)),
    )
    while not (long.done.is_set() and short.done.is_set()):
        runner.tick()
    assert finished_while_prefilling == [True, True, True]
    assert runner.decoder.forwards.prefill_s > 0
    for res in long.wait().results + short.wait().results:
        ref = plain_generate(tiny_model, res.request.prompt_ids, res.request.sampling, eos_ids=[])
        assert res.output.token_ids == ref.token_ids


def test_a_request_waits_for_kv_room_and_one_too_big_alone_is_refused(tiny_model):
    """A KV budget of 50 tokens a row: two requests of 30 tokens each run one after the other
    (together the dense cache would hold 2 x 30), and one of 60 alone fails its own
    submission, saying why; every trajectory still equals plain."""
    from tts_service.generation import InputTooLongError

    gen = make_generator(tiny_model)
    gen.kv_budget = 50 * gen.slot_bytes
    runner = TrajectoryRunner(gen, 4)
    rows_seen: list[int] = []

    def request(i: int, n: int) -> TrajectoryRequest:
        sampling = SamplingConfig(temperature=0, max_new_tokens=n, seed=i)
        prompt = _prompts()[i]
        return TrajectoryRequest(
            "p", i, prompt, sampling, DRAFTER_CONFIGS["pld"], InMemoryNgramStore()
        )

    fits = runner.submit([request(0, 30 - len(_prompts()[0])), request(1, 30 - len(_prompts()[1]))])
    too_big = runner.submit([request(2, 60)])
    while not (fits.done.is_set() and too_big.done.is_set()):
        runner.tick()
        rows_seen.append(len(runner.decoder.active) + len(runner.decoder.joining))
    assert max(rows_seen) == 1
    with pytest.raises(InputTooLongError, match="KV cache"):
        too_big.wait()
    for res in fits.wait().results:
        ref = plain_generate(tiny_model, res.request.prompt_ids, res.request.sampling, eos_ids=[])
        assert res.output.token_ids == ref.token_ids
