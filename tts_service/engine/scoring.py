"""Log-probabilities of given tokens under the target: what `logprobs` and `echo` return.

One teacher-forced forward over the tokens (a prefill), projected through the output head a
chunk of positions at a time, so a long context never holds `[tokens, vocab]` logits at once.
They are the target's raw distribution: the log-softmax of its logits (in fp32 at least), before
temperature, top-k/p or min-p (vLLM's default, `raw_logprobs`). So they depend on the tokens
alone, never on the speculative method that committed them or on the sampling settings: a
token's logprob is the same whichever drafter proposed it, and the same as plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

CHUNK = 256  # positions projected through the output head at once


@dataclass(frozen=True)
class TokenLogprobs:
    """Per scored token i (from `start`): its logprob given the tokens before it and the `top`
    most likely tokens there. The first token of a sequence has no context: None, no top."""

    logprobs: list[float | None]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@torch.inference_mode()
def score_tokens(
    model: PreTrainedModel, ids: Sequence[int], start: int, top: int, chunk: int = CHUNK
) -> TokenLogprobs:
    """The logprobs of `ids[start:]`, each given the tokens before it, with the `top` most
    likely tokens at each (0: none)."""
    if not 0 <= start <= len(ids):
        raise ValueError(f"start {start} outside 0..{len(ids)}")
    first = [None] if start == 0 and ids else []
    begin = max(start, 1)  # position 0 has no distribution before it
    out = TokenLogprobs(list(first), [[] for _ in first], [[] for _ in first])
    if begin >= len(ids):
        return out
    device = next(model.parameters()).device
    inputs = torch.tensor([list(ids[:-1])], dtype=torch.long, device=device)
    hidden = model.get_decoder()(input_ids=inputs, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    targets = torch.tensor(list(ids[begin:]), dtype=torch.long, device=device)
    for a in range(begin - 1, len(ids) - 1, chunk):  # hidden[a] predicts ids[a + 1]
        b = min(a + chunk, len(ids) - 1)
        logits = head(hidden[a:b])
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        picked = logp.gather(1, targets[a + 1 - begin : b + 1 - begin, None])[:, 0]
        out.logprobs.extend(picked.tolist())
        if top > 0:
            values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
            out.top_ids.extend(indices.tolist())
            out.top_logprobs.extend(values.tolist())
        else:
            out.top_ids.extend([] for _ in range(b - a))
            out.top_logprobs.extend([] for _ in range(b - a))
    return out
