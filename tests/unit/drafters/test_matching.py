"""The exact-match index (the spines of Goose and STAND + spine): matches across documents,
longest first, and finished documents forgotten past its token bound."""

from __future__ import annotations

from tts_service.drafters.matching import ExactMatchIndex


def test_exact_match_index_finds_matches_across_documents_longest_first():
    index = ExactMatchIndex((3, 2))
    a, b = index.new_doc(), index.new_doc()
    index.sync(a, [1, 2, 3, 4, 5, 6])
    index.sync(b, [9, 2, 3])
    found = index.matches(b, 3)
    assert [(m.order, m.continuation) for m in found] == [(2, (4, 5, 6))]
    index.sync(b, [9, 2, 3, 4])
    assert index.matches(b, 2)[0].order == 3 and index.matches(b, 2)[0].continuation == (5, 6)


def test_exact_match_index_forgets_finished_documents_past_its_token_bound():
    index = ExactMatchIndex((2,), max_tokens=10)
    old, live = index.new_doc(), index.new_doc()
    index.sync(old, [1, 2, 3, 4, 5, 6])
    index.sync(live, [7, 8, 1, 2])
    assert index.matches(live, 2)[0].continuation == (3, 4)
    index.sync(live, [7, 8, 1, 2, 9])  # 11 tokens > 10: the other document goes
    assert index.size == 5 and index.docs[old] == []
    index.sync(live, [7, 8, 1, 2, 9, 7, 8])
    assert index.matches(live, 3)[0].continuation == (1, 2, 9)  # the live one still indexes


def test_suffix_counts_count_every_continuation_of_the_longest_suffix():
    from tts_service.drafters.matching import SuffixCounts

    counts = SuffixCounts((4, 2))
    a, b = counts.new_doc(), counts.new_doc()
    counts.sync(a, [1, 2, 3, 4, 5, 9])
    counts.sync(b, [7, 2, 3, 4, 5, 8, 0])
    assert counts.lookup([0, 2, 3, 4, 5]) == (4, {9: 1, 8: 1})  # both documents
    assert counts.lookup([6, 4, 5]) == (2, {9: 1, 8: 1})  # backs off to 2 tokens
    assert counts.lookup([5, 8]) == (2, {0: 1})
    assert counts.lookup([8, 0]) == (0, {})  # a document's last n-gram has no continuation yet
    counts.sync(b, [7, 2, 3, 4, 5, 8, 0, 2, 3])  # grows: only the new n-grams are counted
    assert counts.lookup([5, 8, 0]) == (2, {2: 1})
    assert counts.lookup([2, 3]) == (2, {4: 2})


def test_suffix_counts_drop_finished_documents_past_their_token_bound():
    from tts_service.drafters.matching import SuffixCounts

    counts = SuffixCounts((2,), max_tokens=10)
    old, new = counts.new_doc(), counts.new_doc()
    counts.sync(old, [1, 2, 3, 4, 5, 6])
    counts.sync(new, [7, 8, 9, 1, 2, 0])  # 12 tokens > 10: `old` is dropped
    assert counts.size == 6
    assert counts.lookup([1, 2]) == (2, {0: 1})  # only the open document's continuation
