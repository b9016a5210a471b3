"""Gumbel-Top-K without replacement (Kool et al. 2019) and the noise it reads: the top k of
log q_i + G_i are a sample in sequential-sampling order. Shared by the drafters that draw
children (`stand`, `stand_dyn`, `gtcp`) and the compiled ones (`stand_compiled`,
`stand_dyn_compiled`)."""

from __future__ import annotations

import math

import numpy as np

from tts_service.engine.streams import Stream, stream_seed


class GumbelNoise:
    """A buffer of Gumbel(0, 1) noise: every value is handed out once; refilled when short.

    It reads the draft stream of trajectory `seed`, never the verifier's (`engine.streams`).
    The noise is host data, so it is drawn with numpy: a torch refill dispatched six ops on
    tiny tensors, one refill per row every few hundred nodes, which made the host's op count
    grow with the rows. The Python drafter takes floats (`take`); the compiled one
    reads a window of the buffer and of the next one (`window`, `advance`), drawn early from
    the same stream, so both see the same values in the same order.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.rng = np.random.Generator(np.random.PCG64(stream_seed(seed, Stream.DRAFT)))
        self.array = np.zeros(0)  # the current buffer
        self.values: list[float] | None = []  # the same as floats, made at `take`'s need
        self.ahead: np.ndarray | None = None  # the next buffer, once a window asked for it
        self.pos = 0
        self.refills = 0

    def _refill(self, n: int) -> None:
        ahead, self.ahead = self.ahead, None
        assert ahead is None or len(ahead) >= n, "a window's next buffer holds what it read"
        self.array = ahead if ahead is not None else self._draw(n)
        self.values = None
        self.pos = 0
        self.refills += 1

    def _draw(self, n: int) -> np.ndarray:
        return self.rng.gumbel(size=max(self.size, n))

    def take(self, n: int) -> list[float]:
        if self.pos + n > len(self.array):  # the tail is discarded, never wrapped around
            self._refill(n)
        if self.values is None:
            self.values = self.array.tolist()
        out = self.values[self.pos : self.pos + n]
        self.pos += n
        return out

    def window(self, need: int) -> tuple[np.ndarray, int, np.ndarray]:
        """What a compiled draft reading at most `need` values (≤ `size`) sees: the buffer's
        next values, how many it has left, and the next buffer's first where the read may run
        past this one (else none: drawn when first needed, the stream's same values)."""
        assert need <= self.size, "a step may read no more than a buffer holds"
        rest, left = self.array[self.pos : self.pos + need], len(self.array) - self.pos
        if left >= need:
            return rest, left, rest[:0]
        if self.ahead is None:
            self.ahead = self._draw(need)
        return rest, left, self.ahead[:need]

    def advance(self, refilled: bool, pos: int) -> None:
        """After a compiled draft: it moved to the next buffer (then read `pos` of it), or read
        `pos` more of this one."""
        if refilled:
            self._refill(0)
        self.pos += pos


def gumbel_top_k(ids: list[int], probs: list[float], k: int, noise: list[float]) -> list[int]:
    """k ids sampled without replacement from `probs` (any positive scale), in sampling order."""
    keys = [math.log(p) + g for p, g in zip(probs, noise, strict=True)]
    order = sorted(range(len(ids)), key=lambda i: -keys[i])
    return [ids[i] for i in order[:k]]
