"""Answer extraction, equivalence and majority voting for best-of-N trajectories.

Best-of-N only helps if answers that mean the same thing are counted together: `\\frac{1}{2}`,
`0.5` and `1/2` must share one vote. One module per stage, each depending only on the ones
before it: `extract` (answer from raw text), `normalize` (canonical strings), `equivalence`
(math values), `vote` (majority vote, early stop, grading). For math, extraction and
equivalence are HuggingFace's math-verify, run by `mathverify` in a child process with a
timeout, so this package imports neither it nor sympy and stays light.
"""

from tts_service.aggregate.equivalence import math_equal
from tts_service.aggregate.extract import TASKS, Task, extract_answer
from tts_service.aggregate.normalize import (
    normalize_answer,
    normalize_choice,
    normalize_code,
    normalize_math,
)
from tts_service.aggregate.vote import (
    Vote,
    is_correct,
    leader_is_final,
    majority_vote,
    with_indices,
)

__all__ = [
    "TASKS",
    "Task",
    "Vote",
    "extract_answer",
    "is_correct",
    "leader_is_final",
    "majority_vote",
    "math_equal",
    "normalize_answer",
    "normalize_choice",
    "normalize_code",
    "normalize_math",
    "with_indices",
]
