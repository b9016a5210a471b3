"""A trajectory's draft and verification streams are independent (the exactness breach)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tts_service.drafters.registry import DraftEnv, build_drafter
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.seam import DraftContext
from tts_service.engine.streams import (
    Stream,
    drafter_seed,
    new_run_nonce,
    row_salt,
    stream_generator,
    stream_seed,
)
from tts_service.engine.verify import verify_sampling


def test_draft_and_verify_seeds_never_meet():
    seeds = range(20_000)
    draft = {stream_seed(s, Stream.DRAFT) for s in seeds}
    verify = {stream_seed(s, Stream.VERIFY) for s in seeds}
    assert len(draft) == len(verify) == len(seeds)  # no two trajectories share a stream
    assert not draft & verify  # no trajectory's draft stream is any trajectory's verifier's
    assert all(0 <= x < 2**63 for x in draft | verify)


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1, 2**63 - 1])
def test_the_two_streams_of_a_trajectory_differ(seed):
    a = torch.rand(64, generator=stream_generator(seed, Stream.DRAFT), dtype=torch.float64)
    b = torch.rand(64, generator=stream_generator(seed, Stream.VERIFY), dtype=torch.float64)
    assert not torch.equal(a, b)
    again = torch.rand(64, generator=stream_generator(seed, Stream.DRAFT), dtype=torch.float64)
    assert torch.equal(a, again)  # and each is reproducible


# the model-free case: a stored q far from the target's p
Q_IDS, Q_PROBS = (0, 1, 2), (0.6, 0.3, 0.1)
P = torch.tensor([0.3, 0.3, 0.2, 0.2], dtype=torch.float64)


def _root_tokens(drafter_seed, verify_seed, draws: int) -> list[int]:
    """One root verification per draw, each with a fresh drafter and verifier, seeded as the
    caller says."""
    cfg = StandDrafterConfig(num_nodes=2, tree="stand-625")
    out = []
    for s in range(draws):
        store = InMemoryNgramStore()
        store.add([NgramRow((9,), Q_IDS, Q_PROBS)])
        drafter = build_drafter(cfg, DraftEnv(4, store, drafter_seed(s)))
        tree = drafter.draft(DraftContext([9], 1, 2, greedy=False))
        p = P.expand(tree.size, -1)
        acc = verify_sampling(tree, p, stream_generator(verify_seed(s), Stream.VERIFY))
        out.append(acc.committed[0])
    return out


def _pvalue(tokens: list[int]) -> float:
    counts = [tokens.count(t) for t in range(4)]
    return float(chisquare(counts, [float(x) * len(tokens) for x in P]).pvalue)


@pytest.mark.statistical
def test_production_seeding_keeps_the_root_token_exact():
    """The drafter gets the trajectory seed, the verifier the same seed: as every caller does."""
    assert _pvalue(_root_tokens(lambda s: s, lambda s: s, 4000)) > 1e-3


@pytest.mark.statistical
def test_a_shared_stream_fails_the_same_test(monkeypatch):
    """Test of the test: the Gumbel noise drawn from the verifier's own uniforms (the breach:
    the uniform that accepts the root's first child is the one that keyed it)."""
    import tts_service.drafters.stand as stand
    import tts_service.drafters.stand_compiled as stand_compiled

    class SharedNoise(stand.GumbelNoise):
        def __init__(self, size: int, seed: int) -> None:
            super().__init__(size, seed)
            self.gen = stream_generator(seed, Stream.VERIFY)

        def _draw(self, n: int) -> np.ndarray:
            u = torch.rand(max(self.size, n), generator=self.gen, dtype=torch.float64)
            return (-torch.log(-torch.log(u.clamp_(min=1e-300)))).numpy()

    # both drafters' noise (the compiled one drafts here: an in-process store)
    monkeypatch.setattr(stand, "GumbelNoise", SharedNoise)
    monkeypatch.setattr(stand_compiled, "GumbelNoise", SharedNoise)
    assert _pvalue(_root_tokens(lambda s: s, lambda s: s, 4000)) < 1e-6


def test_salted_streams_never_meet_each_other_or_the_seed_alone():
    """Rows of two problems, two runs and every index share seeds, never keys."""
    salts = [row_salt(n, p, i) for n in (0, 1) for p in ("a", "b", "a/1") for i in range(50)]
    keys = {stream_seed(s, Stream.VERIFY, salt) for s in range(50) for salt in salts}
    assert len(keys) == 50 * len(salts)
    assert not keys & {stream_seed(s, Stream.VERIFY) for s in range(50)}
    assert row_salt(1, "a/1", 2) != row_salt(1, "a", 12)  # the id's length delimits it


def test_a_drafting_rows_draft_seed_is_salted_a_plain_rows_is_its_own():
    assert drafter_seed(7, "") == 7
    salted = {drafter_seed(7, row_salt(1, p, 0)) for p in ("a", "b")}
    assert len(salted) == 2 and 7 not in salted
    assert new_run_nonce() != new_run_nonce()
