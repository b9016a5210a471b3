"""Log-probabilities in OpenAI's two response shapes: chat's `logprobs.content` and the legacy
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` (what lm-eval's
`local-completions` reads for loglikelihood tasks). The numbers come from
`engine.scoring.score_tokens` (the target's raw distribution); this module only formats them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tts_service.engine.scoring import TokenLogprobs


@dataclass(frozen=True)
class ScoredTokens:
    """Tokens and their scores, aligned (`scores` has one entry per token)."""

    ids: Sequence[int]
    scores: TokenLogprobs


class LogprobFormat:
    """Token ids -> the strings OpenAI shows (each token decoded alone, as vLLM does)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _texts(self, ids: Sequence[int]) -> list[str]:
        return self.tokenizer.batch_decode([[t] for t in ids])

    def _alternatives(self, s: TokenLogprobs, top: int) -> list[list[tuple[str, float]]]:
        """Per token, its `top` most likely tokens as (string, logprob): one decode call."""
        texts = iter(self._texts([t for ids in s.top_ids for t in ids[:top]]))
        return [[(next(texts), lp) for lp in lps[:top]] for lps in s.top_logprobs]

    def chat(self, scored: ScoredTokens, top: int) -> dict:
        """`choices[i].logprobs` of a chat completion: per token its string, logprob and UTF-8
        bytes, and the `top` most likely tokens there."""
        texts = self._texts(scored.ids)
        alts = self._alternatives(scored.scores, top)
        content = [
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": a, "bytes": list(t.encode())} for t, a in alt
                ],
            }
            for text, lp, alt in zip(texts, scored.scores.logprobs, alts, strict=True)
        ]
        return {"content": content, "refusal": None}

    def completion(self, scored: ScoredTokens, top: int) -> dict:
        """`choices[i].logprobs` of a completion: the tokens, their logprobs (None for a
        sequence's first token), at each the `top` most likely and the chosen token (OpenAI's
        "up to logprobs + 1"), and each token's character offset in the returned text."""
        texts = self._texts(scored.ids)
        tops: list[dict[str, float] | None] = []
        for text, lp, alt in zip(
            texts, scored.scores.logprobs, self._alternatives(scored.scores, top), strict=True
        ):
            if lp is None:
                tops.append(None)
            else:
                shown = dict(alt)
                shown.setdefault(text, lp)
                tops.append(shown)
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": scored.scores.logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
