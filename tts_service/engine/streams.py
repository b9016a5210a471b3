"""The random streams of one trajectory, derived from its sampling seed in separate domains.

A trajectory has one integer seed (`SamplingConfig.seed`). Two kinds of randomness must be
independent of each other for speculative sampling to stay exact:

* ``Stream.DRAFT``: what a drafter draws its tree with (STAND's Gumbel keys, PTD's choices).
* ``Stream.VERIFY``: what the verifier accepts or rejects with and draws the bonus token from;
  plain sampling draws from it too, so plain decoding through the speculative engine with no
  drafts commits exactly what `plain_generate` commits.

If both came from `manual_seed(seed)` they would be the same numbers: the uniform that accepts
the root's first child would be the one that set the Gumbel key of the top candidate, and
whether a draft is accepted would depend on which token was drafted. Each stream's seed is
therefore a hash of (trajectory seed, domain); every caller gets its generators here.
"""

from __future__ import annotations

import hashlib
from enum import Enum

import torch


class Stream(Enum):
    DRAFT = "draft"
    VERIFY = "verify"


def stream_seed(seed: int, stream: Stream) -> int:
    """A 63-bit seed for `stream` of the trajectory seeded with `seed` (any int)."""
    digest = hashlib.blake2b(f"tts-service/{stream.value}/{seed}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def stream_generator(seed: int, stream: Stream, device: torch.device | str = "cpu"):
    """A fresh `torch.Generator` on `device` for `stream` of trajectory `seed`."""
    return torch.Generator(device=device).manual_seed(stream_seed(seed, stream))
