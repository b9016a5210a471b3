"""Voting, early stop and grading: what best-of-N counts as "the same answer"."""

from __future__ import annotations

import pytest

from tests.unit.aggregate.test_extract import MATH_OUTPUT
from tts_service.aggregate.extract import extract_answer
from tts_service.aggregate.vote import Vote, is_correct, leader_is_final, majority_vote


def test_vote_groups_equivalent_math_answers():
    answers = ["0.5", r"\frac{1}{3}", r"\frac{1}{2}", "1/2", r"\frac{1}{3}"]
    vote = majority_vote(answers, "math")
    assert vote.answer == "0.5"  # winner in the form of its first occurrence
    assert vote.votes == {"0.5": 3, r"\frac{1}{3}": 2}
    assert vote.winner_indices == (0, 2, 3)
    assert vote.share == pytest.approx(3 / 5)


def test_vote_counts_missing_answers():
    vote = majority_vote(["C", None, "c", None, "B"], "choice")
    assert vote == Vote(
        answer="C",
        votes={"C": 2, "B": 1},
        share=2 / 5,  # trajectories without an answer stay in the denominator
        num_trajectories=5,
        num_no_answer=2,
        winner_indices=(0, 2),
    )


def test_vote_all_missing():
    vote = majority_vote([None, None, None], "math")
    assert vote.answer is None and vote.share == 0 and vote.votes == {}
    assert vote.num_no_answer == 3 and vote.num_trajectories == 3
    assert majority_vote([], "choice").answer is None


def test_vote_tie_goes_to_first_appearance():
    assert majority_vote(["B", "A", "A", "B"], "choice").answer == "B"
    assert majority_vote(["A", "B", "B", "A"], "choice").answer == "A"
    assert majority_vote([None, "7", "3", "3", "7"], "math").answer == "7"


def test_vote_groups_code_by_normalised_form():
    v1 = "def f(x):\n    return x * 2"
    v1_commented = "def f(x):\n    # twice\n    return x * 2   \n"
    v2 = "def f(x):\n    return x + x"
    vote = majority_vote([v2, v1, v1_commented, None], "code")
    assert vote.answer == v1 and vote.winner_indices == (1, 2)
    assert vote.votes == {v2: 1, v1: 2} and vote.num_no_answer == 1


def test_vote_code_only_passing_trajectories_vote():
    good = "def f(x):\n    return x * 2"
    bad = "def f(x):\n    return x ** 2"
    answers = [bad, bad, bad, good, None]
    vote = majority_vote(answers, "code", tests_outcomes=[False, False, False, True, True])
    assert vote.answer == good and vote.votes == {good: 1} and vote.winner_indices == (3,)
    assert vote.share == pytest.approx(1 / 5) and vote.num_no_answer == 1
    assert majority_vote([bad], "code", tests_outcomes=[False]).answer is None
    with pytest.raises(ValueError):
        majority_vote([bad, good], "code", tests_outcomes=[True])
    with pytest.raises(ValueError):
        majority_vote(["A"], "choice", tests_outcomes=[True])


def test_vote_from_raw_model_outputs():
    outputs = [MATH_OUTPUT, r"It is $\boxed{0.5}$.", "I could not finish the", r"\boxed{2}"]
    vote = majority_vote([extract_answer(o, "math") for o in outputs], "math")
    assert vote.answer == r"\frac{1}{2}" and vote.votes[r"\frac{1}{2}"] == 2
    assert vote.num_no_answer == 1


def test_vote_from_plain_text_outputs():
    """SmolLM2 writes no `\\boxed{}` (issue 17): its plain-text answers must still vote."""
    outputs = [
        "17 + 25 = 32\n\nThe final answer is 32.",
        "So the final answer is 32.",
        "17 + 25 = 42",
        "I'm sorry, I can't help with that.",
        "The final answer is $32$.",
    ]
    vote = majority_vote([extract_answer(o, "math") for o in outputs], "math")
    assert vote.answer == "32" and vote.votes == {"32": 3, "42": 1}
    assert vote.winner_indices == (0, 1, 4) and vote.num_no_answer == 1
    assert vote.share == pytest.approx(3 / 5)


def test_vote_groups_padded_aime_answers():
    vote = majority_vote(["034", "033", "33", r"\boxed{33}", None], "math")
    assert vote.answer == "033" and vote.votes == {"034": 1, "033": 3}
    assert vote.num_no_answer == 1


# ------------------------------------------------------------------------------ early stop, grade


@pytest.mark.parametrize(
    "votes, remaining, final",
    [
        ({"A": 5, "B": 2}, 2, True),
        ({"A": 5, "B": 2}, 3, False),  # 5 vs 2+3 would tie: not final
        ({"A": 3}, 2, True),  # the runner-up may be a class not seen yet
        ({"A": 3}, 3, False),
        ({"A": 2, "B": 2}, 0, False),  # already a tie
        ({"A": 1, "B": 0}, 0, True),
        ({}, 0, False),
    ],
)
def test_leader_is_final(votes, remaining, final):
    assert leader_is_final(votes, remaining) is final


def test_is_correct():
    assert is_correct(r"\dfrac{1}{2}", "0.5", "math")
    assert is_correct("033", "33", "math")
    assert not is_correct("0.4", "0.5", "math")
    assert not is_correct(None, "0.5", "math")
    assert is_correct("c", "C", "choice")
    assert not is_correct("B", "C", "choice")
    with pytest.raises(ValueError):
        is_correct("print(1)", "print(1)", "code")
