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

A row whose drafter reads state beyond its own row (a problem's store, the per-model
calibration and successor tables, the global tier) also has a *salt*, `row_salt(run nonce,
problem, trajectory)`: no such state may have been written by a row verified with the same
uniforms, or a draft would depend on the numbers that verify it. The run nonce is drawn per run
(`new_run_nonce`) unless the user pins it to reproduce a run, and `drafters.registry.RowDrafters`
refuses a verify key that the model's or the store's state has already seen (docs/design.md,
"Random streams").
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch where tensors are made: the CLI's parser imports this module
    import torch


class Stream(Enum):
    DRAFT = "draft"
    VERIFY = "verify"


def stream_seed(seed: int, stream: Stream, salt: str = "") -> int:
    """A 63-bit seed for `stream` of the trajectory seeded with `seed` (any int) and salted
    with `salt` (`row_salt`; empty for a row that reads no shared state: plain decoding)."""
    name = f"tts-service/{stream.value}/{seed}" + (f"/{salt}" if salt else "")
    digest = hashlib.blake2b(name.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def verify_key(seed: int, salt: str) -> int | None:
    """The key a salted row's verification is claimed under (`NgramStore.claim`): its verify
    stream's seed; None for an unsalted row (it reads no shared state)."""
    return stream_seed(seed, Stream.VERIFY, salt) if salt else None


def drafter_seed(seed: int, salt: str) -> int:
    """The seed a row's drafter derives its draft stream from (`DraftEnv.seed`): the
    trajectory's own where unsalted, else a hash of both. Rows that share drafter state must not
    share draft noise either: whether a row draws its children from q may hang on what another
    row's draws taught the calibration, and a drawn child must be a draw from q independent of
    that choice."""
    return seed if not salt else stream_seed(seed, Stream.DRAFT, salt)


def new_run_nonce() -> int:
    """A fresh run nonce: 63 random bits, so two runs' salts never meet (by chance, 2^-63)."""
    return secrets.randbits(63)


def row_salt(run_nonce: int, problem_id: str, index: int) -> str:
    """The salt of trajectory `index` of `problem_id` in the run `run_nonce`: unique among the
    rows of every run whose state a drafter may read, where seeds repeat (trajectory i of every
    problem has the job's seed + i, and a re-run or a Serve request may pass the same seed)."""
    return f"{run_nonce}/{len(problem_id)}:{problem_id}/{index}"


def stream_generator(seed: int, stream: Stream, device: torch.device | str = "cpu"):
    """A fresh `torch.Generator` on `device` for `stream` of trajectory `seed`."""
    import torch

    return torch.Generator(device=device).manual_seed(stream_seed(seed, stream))


LANES = 1 << 12
"""Uniforms one counter may draw (`counter_uniforms`): `LANES_PER_NODE` per tree node, so trees
of up to 1365 nodes (calibration's largest is 1025)."""
LANES_PER_NODE = 3
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's constants
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser; uint64 products wrap modulo 2^64 as the algorithm wants."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def counter_uniforms(keys: Sequence[int], counters: Sequence[int], lanes: int) -> np.ndarray:
    """`[R, lanes]` float64 uniforms in [0, 1), on the host: lane j of row r is a hash of
    (`keys[r]`, `counters[r]`, j), so every row draws from its own stream in one call for the
    whole batch, and what a row draws does not depend on which rows share its batch.

    `keys`: the rows' stream seeds (`stream_seed(seed, Stream.VERIFY)`); `counters`: a value a
    row never repeats (the verifier uses the root's position); `lanes` at most `LANES`.
    splitmix64 (Steele et al. 2014) over the counter, mixed twice. Hashed with numpy on the
    host: a dozen array ops, where the same hash as torch ops is ~30 dispatches (a GPU
    would launch each), then one copy to the device (`node_uniforms`)."""
    assert lanes <= LANES
    key = np.asarray(keys, dtype=np.uint64)[:, None]
    counter = np.asarray(counters, dtype=np.uint64)[:, None]
    lane = np.arange(1, lanes + 1, dtype=np.uint64)
    x = key + (counter * np.uint64(LANES) + lane) * _GOLDEN
    return (_mix(_mix(x)) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def node_uniform_block(keys: Sequence[int], counters: Sequence[int], nodes: int) -> np.ndarray:
    """`[R, 3 * nodes]` on the host: `node_uniforms`' u, v and w side by side (what a captured
    acceptance's static input holds, `graphs.GraphedAcceptance`). The one place the lane layout
    lives."""
    lanes = counter_uniforms(keys, counters, LANES_PER_NODE * nodes)
    rows = lanes.shape[0]
    return lanes.reshape(rows, nodes, LANES_PER_NODE).transpose(0, 2, 1).reshape(rows, -1)


def node_uniforms(
    keys: Sequence[int], counters: Sequence[int], nodes: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's uniforms for the first `nodes` nodes of each row's tree, `[R, nodes]`
    each, on `device`: (u, accepting or rejecting the node; v, drawing the bonus from its
    residual on the device; w, the host's draw of recursive rejection sampling). A plain step's
    bonus (`decode.plain_generate`) is v of node 0 at the same counter. One copy, split on the
    device without strided views."""
    import torch

    u, v, w = torch.from_numpy(node_uniform_block(keys, counters, nodes)).to(device).split(nodes, 1)
    return u, v, w
