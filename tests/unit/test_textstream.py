"""`StableText` releases a row's text only once it can no longer change: never a stop string or
what follows it, never half a character; all of it, put together, is the final text."""

from __future__ import annotations

from tts_service.textstream import StableText

WORDS = {1: "The", 2: " cat", 3: " sat", 4: " ##", 5: "END", 6: "\ufffd", 7: "é"}


def decode(ids: list[int]) -> str:
    """Token 6 then 7 is one character in bytes: 6 alone is its first byte (shown as U+FFFD)."""
    text = "".join(WORDS[i] for i in ids)
    return text.replace("\ufffdé", "é")


def test_text_is_released_as_it_commits_and_adds_up_to_the_final_text():
    out = StableText(decode)
    assert [out.commit([1]), out.commit([2, 3])] == ["The", " cat sat"]
    assert out.finish("The cat sat") == ""


def test_a_possible_stop_string_is_held_back_and_a_stop_string_never_released():
    out = StableText(decode, stop=(" ##END",))
    released = out.commit([1, 2])  # "The cat": its last 6 characters could start the stop
    assert released == "T"
    released += out.commit([4])  # "The cat ##"
    assert released == "The "
    released += out.commit([5])  # "The cat ##END": the stop string, never released
    assert released == "The "
    assert released + out.finish("The cat") == "The cat"


def test_half_a_character_waits_for_the_rest():
    out = StableText(decode)
    assert out.commit([1, 6]) == "The"
    assert out.commit([7]) == "é"
    assert out.finish("Theé") == ""
