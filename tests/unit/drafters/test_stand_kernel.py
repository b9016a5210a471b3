"""The compiled `stand-dyn` (`stand_dyn_compiled`, `stand_kernel`): the same trees as the Python
drafter, node for node, through the runner (rows joining and leaving, greedy and sampled,
GT-sized); its suffix index counts as `SuffixCounts` does. Losslessness is in the shared
harnesses, where `stand-dyn` is compiled and `stand-dyn-python` is not (tests/conftest.py)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest

from store.base import NgramRow
from store.memory import InMemoryNgramStore, TieredStore
from tests.conftest import save_tiny_model
from tests.unit.drafters.test_stand_compiled import _twin_stores, assert_arrays_lay_out_as_the_trees
from tts_service.drafters.kernels import auto_kernels, kernels_of, preload
from tts_service.drafters.matching import SuffixCounts
from tts_service.drafters.stand import KERNELS as STAND
from tts_service.drafters.stand_dyn import KERNELS as STAND_DYN
from tts_service.drafters.stand_dyn import compiled_applies
from tts_service.drafters.stand_dyn_compiled import CompiledStandDyn, StandDynGroup, warm
from tts_service.drafters.stand_dyn_config import SUFFIX_ORDERS, StandDynDrafterConfig
from tts_service.drafters.suffix_index import SuffixIndex
from tts_service.engine.seam import DraftContext


@pytest.mark.parametrize("max_tokens", [1 << 17, 300])
def test_the_suffix_index_counts_as_suffix_counts(max_tokens):
    """Documents synced in random steps, interleaved; with a small bound the counts restart
    (only the syncing document is counted again) several times."""
    rng = random.Random(max_tokens)
    docs = [[rng.randrange(5) for _ in range(400)] for _ in range(4)]
    ref, index = SuffixCounts(SUFFIX_ORDERS, max_tokens), SuffixIndex(max_tokens)
    ids = [(ref.new_doc(), index.new_doc()) for _ in docs]
    ends = [0] * len(docs)
    for _ in range(300):
        d = rng.randrange(len(docs))
        ends[d] = min(len(docs[d]), ends[d] + rng.randrange(0, 6))
        ref.sync(ids[d][0], docs[d][: ends[d]])
        index.sync(ids[d][1], docs[d][: ends[d]])
        tail = docs[d][max(0, ends[d] - rng.randrange(1, 14)) : ends[d]]
        assert index.lookup(tail) == ref.lookup(tail)
    assert index.size == ref.size


def test_the_compiled_drafter_applies_where_its_trees_are_the_python_ones():
    store = InMemoryNgramStore()
    assert compiled_applies(StandDynDrafterConfig(), store)
    assert not compiled_applies(StandDynDrafterConfig(compiled=False), store)
    assert compiled_applies(StandDynDrafterConfig(drawn=True), store)  # drawn children too
    # unless a step could read more noise than a buffer holds (81 nodes x 10 stored ids)
    assert not compiled_applies(StandDynDrafterConfig(drawn=True, noise_buffer=800), store)
    assert compiled_applies(StandDynDrafterConfig(drawn=False, noise_buffer=800), store)
    assert not compiled_applies(StandDynDrafterConfig(), TieredStore(store, InMemoryNgramStore()))


def test_warm_compiles_and_runs_every_kernel():
    assert warm() > 1  # a tree was drafted from the one stored entry


def test_a_step_whose_counts_restart_midway_drafts_as_row_after_row():
    """A small memory bound makes the suffix counts restart at some row of a step: the group
    drafts the rows before it in one call, restarts, then the rest (`StandDynGroup.draft_all`),
    and every tree equals the Python drafter's, drafting row after row."""
    from tts_service.drafters.goose import AdjacencyTable
    from tts_service.drafters.stand_dyn import AcceptanceCalibration, StandDynDrafter
    from tts_service.drafters.stand_dyn_compiled import CalibrationIndex, SuccessorIndex
    from tts_service.engine.tree import DraftTree

    rng = random.Random(7)
    rows = [
        NgramRow(
            tuple(rng.randrange(8) for _ in range(4)),
            tuple(rng.sample(range(8), 4)),
            (0.4, 0.3, 0.2, 0.1),
        )
        for _ in range(200)
    ]
    plain, indexed = InMemoryNgramStore(), InMemoryNgramStore()
    plain.add(rows)
    indexed.add(rows)
    cfg = StandDynDrafterConfig(num_nodes=6, sizing="fixed", compiled=False)
    counts = SuffixCounts(SUFFIX_ORDERS, max_tokens=120)
    python = [
        StandDynDrafter(cfg, plain, counts, AdjacencyTable(8, 10), AcceptanceCalibration())
        for _ in range(4)
    ]
    group = StandDynGroup()
    group.suffix = SuffixIndex(max_tokens=120)
    group.bind(indexed.compiled(), SuccessorIndex(8), CalibrationIndex())
    compiled = [CompiledStandDyn(cfg, indexed, group) for _ in range(4)]
    docs = [[rng.randrange(8) for _ in range(60)] for _ in range(4)]
    for d in python + compiled:
        d.start([])
    restarts: list[int] = []  # the doc (= row) each restart came at
    reset_for = group.suffix.reset_for
    group.suffix.reset_for = lambda doc: restarts.append(doc) or reset_for(doc)  # type: ignore[method-assign]
    for end in range(10, 60, 7):
        ctxs = [DraftContext(doc[:end], 1, 6) for doc in docs]
        want: list[DraftTree] = [d.draft(c) for d, c in zip(python, ctxs, strict=True)]
        got = group.draft_all(compiled, ctxs)
        assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
        assert group.suffix.size == counts.size  # restarted at the same rows
        for doc in docs:
            assert group.suffix.lookup(doc[end - 9 : end]) == counts.lookup(doc[end - 9 : end])
    assert len(restarts) >= 2 and max(restarts) > 0  # some restart came after a step's first row


def test_the_kernels_preload_in_a_daemon_thread():
    """`kernels.preload` loads a compiled drafter's kernels beside the caller and ends
    (`Generator.load` starts it before the model loads)."""
    for module in (STAND, STAND_DYN):
        thread = preload(module)
        assert thread.daemon
        thread.join(timeout=300)
        assert not thread.is_alive()


def test_the_kernels_a_drafter_config_drafts_with():
    from tts_service.drafters.stand_config import StandDrafterConfig
    from tts_service.drafters.stand_spine import StandSpineDrafterConfig

    assert kernels_of(StandDrafterConfig()) == STAND
    assert kernels_of(StandDrafterConfig(compiled=False)) is None
    assert kernels_of(StandDynDrafterConfig()) == STAND_DYN
    assert kernels_of(StandDynDrafterConfig(drawn=True)) == STAND_DYN
    assert kernels_of(StandDynDrafterConfig(drawn=True, compiled=False)) is None  # CPU `auto`
    assert kernels_of(StandSpineDrafterConfig()) is None
    assert auto_kernels() == STAND_DYN  # `auto` on a GPU


def test_a_cpu_model_load_never_imports_numba(tmp_path):
    """`auto` on a CPU drafts in Python: loading a model there must not pay numba's import."""
    save_tiny_model(tmp_path, 32, seed=5, scale=4.0)
    code = (
        "import sys\n"
        "from tts_service.config import ModelConfig\n"
        "from tts_service.generation import Generator\n"
        f"Generator.load(ModelConfig(name={str(tmp_path)!r}, device='cpu'))\n"
        "print('numba' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("bucket", [False, True])
def test_drawn_and_deterministic_nodes_lay_out_from_the_arrays_as_from_the_trees(bucket):
    """Trees with drawn children beside deterministic ones (calibration lines at random, so
    which plan wins varies per node) lay out from the kernel's arrays (`tree.DrawnArrays`: a
    drawing node's support is its q, any other's its children's tokens) exactly as the loop over
    their nodes does, field for field; two problems' batches in one step, and a third of
    `stand`'s (every child drawn, no `sampled` array, ids as wide as the store's top-k)."""
    from tts_service.drafters.stand_compiled import CompiledStand, new_group
    from tts_service.drafters.stand_config import StandDrafterConfig
    from tts_service.drafters.stand_dyn_compiled import CalibrationIndex, SuccessorIndex

    rng = random.Random(13)
    mixed = stand_trees = 0
    for trial in range(20):
        trees = []
        for _ in range(2):  # two problems' batches
            store = _twin_stores(rng, zeros=True)[1]
            cal = CalibrationIndex()
            cal.a[:] = [rng.random() * 0.3 for _ in range(len(cal.a))]
            cal.b[:] = [rng.random() for _ in range(len(cal.b))]
            group = StandDynGroup()
            group.bind(store.compiled(), SuccessorIndex(8), cal)
            cfg = StandDynDrafterConfig(num_nodes=rng.choice([4, 12, 24]), drawn=True)
            rows = [CompiledStandDyn(cfg, store, group, seed=trial * 10 + i) for i in range(3)]
            for row in rows:
                row.start([])
            ctxs = [DraftContext([rng.randrange(8) for _ in range(6)], 1, 24) for _ in rows]
            trees += group.draft_all(rows, ctxs)
        stand_cfg = StandDrafterConfig(tree="stand-625", num_nodes=rng.choice([4, 24]))
        stand_group = new_group(stand_cfg)
        stand_group.bind(store.compiled())
        stand_rows = [CompiledStand(stand_cfg, store, stand_group, seed=trial) for _ in range(2)]
        trees += stand_group.draft_all(stand_rows, ctxs[:2])
        trees = [t for t in trees if any(t.sampled)]  # the rows rule (c) walks
        assert all(t.arrays is not None for t in trees)
        mixed += sum(not all(t.sampled[1:]) for t in trees)
        stand_trees += sum(t.arrays.batch.sampled is None for t in trees)  # type: ignore[union-attr]
        n = max(t.size for t in trees) + rng.randrange(0, 3)
        assert_arrays_lay_out_as_the_trees(trees[::-1], n, bucket)
    assert mixed > 10  # trees with drawn and deterministic children both
    assert stand_trees > 10


def test_rows_of_one_group_draw_their_own_noise_through_refills():
    """Two configs share a problem's group (one kernel call): a small tree with a noise buffer
    just big enough for it beside a big one reads a window its own size, so each row's noise,
    refills included, and so its trees, are the Python drafter's."""
    from tts_service.drafters.goose import AdjacencyTable
    from tts_service.drafters.stand_dyn import AcceptanceCalibration, StandDynDrafter
    from tts_service.drafters.stand_dyn_compiled import CalibrationIndex, SuccessorIndex

    rng = random.Random(17)
    plain, indexed = _twin_stores(rng, rows=200, width=5)
    big = StandDynDrafterConfig(num_nodes=24, sizing="fixed", drawn=True)
    small = StandDynDrafterConfig(num_nodes=2, sizing="fixed", drawn=True, noise_buffer=30)
    assert compiled_applies(small, indexed)
    counts, successors = SuffixCounts(SUFFIX_ORDERS), AdjacencyTable(8, 10)
    calibration = AcceptanceCalibration()
    python = [
        StandDynDrafter(cfg, plain, counts, successors, calibration, seed=s)
        for s, cfg in ((1, big), (2, small))
    ]
    group = StandDynGroup()
    group.bind(indexed.compiled(), SuccessorIndex(8), CalibrationIndex())
    compiled = [CompiledStandDyn(cfg, indexed, group, seed=s) for s, cfg in ((1, big), (2, small))]
    for d in python + compiled:
        d.start([])
    docs = [[rng.randrange(8) for _ in range(80)] for _ in compiled]
    for end in range(6, 80, 2):
        ctxs = [DraftContext(doc[:end], 1, 24) for doc in docs]
        want = [d.draft(c) for d, c in zip(python, ctxs, strict=True)]
        assert group.draft_all(compiled, ctxs) == want
    assert any(any(t.sampled) for t in want)
    assert compiled[1].noise.refills == python[1].noise.refills > 3


def test_a_top_k_two_store_and_a_greedy_row_beside_drawing_rows():
    """One kernel call for a problem's rows where a greedy row (no drawn child) sits between
    drawing rows, over a top-k-2 store, so deterministic nodes of drawing rows' trees have more
    children than the store's top-k (the successor table's and suffix counts' candidates):
    trees equal to the Python drafters', and the rule (c) layout from the kernel's arrays equal
    to the loop over the trees' nodes."""
    from tts_service.drafters.goose import AdjacencyTable
    from tts_service.drafters.stand_dyn import AcceptanceCalibration, StandDynDrafter
    from tts_service.drafters.stand_dyn_compiled import CalibrationIndex, SuccessorIndex

    rng = random.Random(23)
    plain, indexed = _twin_stores(rng, rows=200, width=2, topk=2)
    cfg = StandDynDrafterConfig(num_nodes=16, sizing="fixed", drawn=True, noise_buffer=60)
    assert compiled_applies(cfg, indexed)
    counts, successors = SuffixCounts(SUFFIX_ORDERS), AdjacencyTable(8, 10)
    calibration = AcceptanceCalibration()
    python = [
        StandDynDrafter(cfg, plain, counts, successors, calibration, seed=s) for s in range(3)
    ]
    group = StandDynGroup()
    group.bind(indexed.compiled(), SuccessorIndex(8), CalibrationIndex())
    compiled = [CompiledStandDyn(cfg, indexed, group, seed=s) for s in range(3)]
    for d in python + compiled:
        d.start([])
    docs = [[rng.randrange(8) for _ in range(60)] for _ in compiled]
    wide = 0
    for end in range(6, 60, 2):
        ctxs = [DraftContext(doc[:end], 1, 16, greedy=b == 1) for b, doc in enumerate(docs)]
        want = [d.draft(c) for d, c in zip(python, ctxs, strict=True)]
        got = group.draft_all(compiled, ctxs)
        assert got == want
        assert not any(got[1].sampled)  # the greedy row draws nothing
        drawing = [t for t in got if any(t.sampled)]
        for t in drawing:  # a node whose > 2 children are deterministic
            kept = Counter(t.parents[v] for v in range(1, t.size) if not t.sampled[v])
            wide += any(n > 2 for n in kept.values())
        if drawing:
            assert_arrays_lay_out_as_the_trees(drawing, max(t.size for t in drawing), False)
    assert wide > 0
