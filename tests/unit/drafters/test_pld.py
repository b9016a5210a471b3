"""Prompt lookup decoding on hand-made token sequences, with the reason next to each case."""

from __future__ import annotations

from tts_service.drafters.pld import PldDrafterConfig, PromptLookupDrafter
from tts_service.engine.seam import DraftContext


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
