"""Log-probabilities of given tokens under the target: what `logprobs` and `echo` return.

One teacher-forced forward over the tokens (a prefill), a chunk of positions at a time over a
cache, each chunk projected through the output head: a long context never holds `[tokens,
vocab]` logits, nor stalls the batch decoding beside it for more than a chunk.
They are the target's raw distribution: the log-softmax of its logits (in fp32 at least), before
temperature, top-k/p or min-p (vLLM's default, `raw_logprobs`). So they depend on the tokens
alone, never on the speculative method that committed them or on the sampling settings: a
token's logprob is the same whichever drafter proposed it, and the same as plain decoding's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import DynamicCache, PreTrainedModel

CHUNK = 256  # positions run (and projected through the output head) at once
T = TypeVar("T")


@dataclass(frozen=True)
class TokenLogprobs:
    """Per scored token i (from `start`): its logprob given the tokens before it and the `top`
    most likely tokens there. The first token of a sequence has no context: None, no top."""

    logprobs: list[float | None]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def _now(work: Callable[[], T]) -> T:
    return work()


@torch.inference_mode()
def score_tokens(
    model: PreTrainedModel,
    ids: Sequence[int],
    start: int,
    top: int,
    chunk: int = CHUNK,
    run: Callable[[Callable[[], torch.Tensor]], torch.Tensor] = _now,
) -> TokenLogprobs:
    """The logprobs of `ids[start:]`, each given the tokens before it, with the `top` most
    likely tokens at each (0: none). The forward runs `chunk` positions at a time over a cache,
    each chunk through `run` (a runner loop's `between_steps`: the batch steps between two
    chunks, so a long context never stalls it)."""
    if not 0 <= start <= len(ids):
        raise ValueError(f"start {start} outside 0..{len(ids)}")
    first = [None] if start == 0 and ids else []
    begin = max(start, 1)  # position 0 has no distribution before it
    out = TokenLogprobs(list(first), [[] for _ in first], [[] for _ in first])
    if begin >= len(ids):
        return out
    device = next(model.parameters()).device
    decoder, cache = model.get_decoder(), DynamicCache(config=model.config)
    inputs = torch.tensor([list(ids[:-1])], dtype=torch.long, device=device)
    for a in range(0, len(ids) - 1, chunk):  # hidden[p] predicts ids[p + 1]
        b = min(a + chunk, len(ids) - 1)

        def forward(a: int = a, b: int = b) -> torch.Tensor:
            out = decoder(input_ids=inputs[:, a:b], past_key_values=cache, use_cache=True)
            return out.last_hidden_state[0]

        hidden = run(forward)
        if b > begin - 1:
            _score(model, hidden[max(0, begin - 1 - a) :], ids, max(a, begin - 1), top, out)
    return out


def _score(
    model: PreTrainedModel,
    hidden: torch.Tensor,  # [positions, hidden] from position `at`
    ids: Sequence[int],
    at: int,
    top: int,
    out: TokenLogprobs,
) -> None:
    """Append the logprobs of `ids[at + 1 : at + 1 + positions]` (and the top alternatives)."""
    logits = model.get_output_embeddings()(hidden)
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    n = hidden.shape[0]
    targets = torch.tensor(list(ids[at + 1 : at + 1 + n]), dtype=torch.long, device=logp.device)
    out.logprobs.extend(logp.gather(1, targets[:, None])[:, 0].tolist())
    if top > 0:
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
        out.top_ids.extend(indices.tolist())
        out.top_logprobs.extend(values.tolist())
    else:
        out.top_ids.extend([] for _ in range(n))
        out.top_logprobs.extend([] for _ in range(n))
