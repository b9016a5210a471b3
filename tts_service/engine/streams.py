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


LANES = 1 << 12
"""Uniforms one counter may draw (`counter_uniforms`): `LANES_PER_NODE` per tree node, so trees
of up to 1365 nodes (calibration's largest is 1025)."""
LANES_PER_NODE = 3
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 products wrap modulo 2^64 as the algorithm wants."""
    x = (x ^ _shift(x, 30)) * _MIX1
    x = (x ^ _shift(x, 27)) * _MIX2
    return x ^ _shift(x, 31)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor, lanes: int) -> torch.Tensor:
    """`[R, lanes]` float64 uniforms in [0, 1): lane j of row r is a hash of (`keys[r]`,
    `counters[r]`, j), so every row draws from its own stream in one call for the whole batch,
    and what a row draws does not depend on which rows share its batch.

    `keys`: `[R]` int64 stream seeds (`stream_seed(seed, Stream.VERIFY)`); `counters`: `[R]`
    int64, a value a row never repeats (the verifier uses the root's position); `lanes` at
    most `LANES`. splitmix64 (Steele et al. 2014) over the counter, mixed twice."""
    assert lanes <= LANES
    lane = torch.arange(lanes, dtype=torch.long, device=keys.device)
    x = keys[:, None] + (counters[:, None] * LANES + lane + 1) * _GOLDEN
    return _shift(_mix(_mix(x)), 11).to(torch.float64) * (1.0 / (1 << 53))


def node_uniforms(
    keys: torch.Tensor, counters: torch.Tensor, nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's uniforms for the first `nodes` nodes of each row's tree, `[R, nodes]`
    each: (u, accepting or rejecting the node; v, drawing the bonus from its residual on the
    device; w, the host's draw of recursive rejection sampling). The one place the lane layout
    lives: a plain step's bonus (`decode.plain_generate`) is v of node 0 at the same counter."""
    lanes = counter_uniforms(keys, counters, LANES_PER_NODE * nodes)
    return lanes[:, 0::3], lanes[:, 1::3], lanes[:, 2::3]
