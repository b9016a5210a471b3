"""Drafters on hand-made token sequences, with the reason next to each case."""

from __future__ import annotations

import torch

from tts_service.config import PldDrafterConfig, RecyclingDrafterConfig
from tts_service.drafters.base import DraftContext, NodeTopK
from tts_service.drafters.pld import PromptLookupDrafter
from tts_service.drafters.recycling import TokenRecyclingDrafter
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


def _ctx(tokens: list[int], max_nodes: int = 64) -> DraftContext:
    return DraftContext(tokens, prompt_len=len(tokens), max_nodes=max_nodes)


def _pld(tokens: list[int], **kw) -> list[int]:
    d = PromptLookupDrafter(PldDrafterConfig(**kw))
    d.start(tokens)
    tree = d.draft(_ctx(tokens))
    assert tree.tokens[0] == tokens[-1]
    return list(tree.tokens[1:])


def test_pld_copies_the_continuation_of_the_longest_match():
    # suffix [1, 2, 3] occurred at the start: copy what followed it
    assert _pld([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], num_draft_tokens=3) == [4, 5, 6]


def test_pld_prefers_the_longest_order_then_the_latest_occurrence():
    # 3-gram [7, 1, 2] matches once (-> 8); the 1-gram [2] alone would match later (-> 5)
    assert _pld([7, 1, 2, 8, 0, 2, 5, 7, 1, 2], num_draft_tokens=1) == [8]
    # only the 1-gram [2] matches; its latest occurrence wins ("not 3")
    assert _pld([2, 3, 4, 2, 5, 6, 2], num_draft_tokens=1) == [5]


def test_pld_drafts_nothing_without_a_match_and_respects_the_budget():
    assert _pld([1, 2, 3, 4]) == []
    d = PromptLookupDrafter(PldDrafterConfig(num_draft_tokens=5))
    d.start([])
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert list(d.draft(_ctx(tokens, max_nodes=2)).tokens[1:]) == [3, 4]


def test_pld_index_grows_incrementally_and_resets_per_trajectory():
    d = PromptLookupDrafter(PldDrafterConfig(num_draft_tokens=2))
    d.start([])
    tokens = [5, 6, 7, 8]
    assert d.draft(_ctx(tokens)).size == 1
    tokens += [5, 6]  # committed later: [5, 6] now matches -> 7, 8
    assert list(d.draft(_ctx(tokens)).tokens[1:]) == [7, 8]
    d.start([])  # a new trajectory forgets the old text
    assert d.draft(_ctx([9, 5, 6])).size == 1


def _observe(d: TokenRecyclingDrafter, tree: DraftTree, rows: list[list[int]]) -> None:
    ids = torch.tensor(rows)
    d.observe(tree, Acceptance((), (), 0), NodeTopK(ids, torch.ones_like(ids, dtype=torch.float64)))


def test_recycling_fills_a_tree_from_the_table_and_prunes_unknown_tokens():
    d = TokenRecyclingDrafter(RecyclingDrafterConfig(k=2, num_nodes=80), vocab_size=20)
    # template order: node 1 = rank 0 of root, node 2 = rank 0 of node 1, node 3 = rank 1 of root
    _observe(d, DraftTree.chain(4, [7]), [[7, 9], [11, 12]])  # 4 -> (7, 9); 7 -> (11, 12)
    tree = d.draft(_ctx([1, 4]))
    assert tree.tokens[0] == 4
    first_level = [tree.tokens[c] for c in tree.children[0]]
    assert first_level == [7, 9]  # rank order; ranks >= k=2 do not exist
    node7 = tree.children[0][0]
    assert [tree.tokens[c] for c in tree.children[node7]] == [11, 12]
    assert tree.children[tree.children[0][1]] == ()  # 9 has no row yet: its subtree is pruned
    assert len(d.draft(_ctx([1, 3])).tokens) == 1  # unknown root: nothing to draft


def test_recycling_overwrites_rows_and_keeps_them_across_trajectories():
    d = TokenRecyclingDrafter(RecyclingDrafterConfig(k=2, num_nodes=4), vocab_size=20)
    _observe(d, DraftTree.root_only(4), [[7, 9]])
    _observe(d, DraftTree.root_only(4), [[3, 2]])  # the paper replaces, it does not merge
    d.start([0])  # hot start: the table persists
    tree = d.draft(_ctx([4], max_nodes=3))  # rank 0 of 3 is unknown and pruned
    assert tree.size == 3 and [tree.tokens[c] for c in tree.children[0]] == [3, 2]
