"""Trajectories from any OpenAI-compatible server (`tts serve`, vLLM, ...) for `jobs.evaluate
--endpoint`: one chat completion with `n` choices per item, through the `openai` client, which
retries what is worth retrying (connection errors, timeouts, 408, 409, 429 and 5xx) with
exponential backoff and jitter, honouring the server's `Retry-After`; a refusal (another 4xx)
is not retried.

The choices become trajectory records shaped like the generator actors' (`text`,
`finish_reason`, `stats`), so grading, votes and the report are the same code path. A server
reports only the total `usage.completion_tokens` of a response, so each choice is credited an
equal share of it, and nothing about forwards (acceptance length is unknown: reported as `-`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import openai

from tts_service.config import SamplingConfig

RETRIES = 6  # with openai's backoff (0.5 s doubling, at most 8 s): about half a minute


class EndpointError(RuntimeError):
    """The server refused a request, never answered through the retries, or answered
    something that is not a chat completion."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the API base, e.g. http://127.0.0.1:8000/v1
    api_key: str | None = None
    timeout_s: float = 3600.0
    retries: int = RETRIES
    client: openai.OpenAI = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        client = openai.OpenAI(
            base_url=self.url.rstrip("/"),
            api_key=self.api_key or "unused",  # the client insists on one (sent either way)
            timeout=self.timeout_s,
            max_retries=self.retries,
        )
        object.__setattr__(self, "client", client)

    def _call(self, what: str, request):
        try:
            return request()
        except openai.APIStatusError as e:
            raise EndpointError(f"{self.url}/{what}: HTTP {e.status_code}: {e.message}") from e
        except openai.APIError as e:  # connection, timeout
            raise EndpointError(f"{self.url}/{what}: {e}") from e
        except (ValueError, AttributeError) as e:  # a body that is not the API's JSON
            raise EndpointError(f"{self.url}/{what}: not an OpenAI reply: {e}") from e

    def model(self) -> str:
        """The first model the server lists (GET /models): what the run is named after. The
        run's first call, so a wrong URL fails after two retries, not the whole backoff."""
        client = self.client.with_options(max_retries=min(self.retries, 2))
        data = self._call("models", lambda: [m.id for m in client.models.list().data])
        if not data:
            raise EndpointError(f"{self.url}/models lists no model")
        return data[0]

    def trajectories(
        self, model: str, prompt: str, n: int, sampling: SamplingConfig, problem_id: str
    ) -> list[dict]:
        """The item's `n` trajectories as records (`index`, `text`, `finish_reason`, `stats`)."""
        start = time.perf_counter()
        reply = self._call(
            "chat/completions",
            lambda: self.client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=sampling.seed,
            ),
        )
        wall_s = time.perf_counter() - start
        try:
            choices = sorted(reply.choices, key=lambda c: c.index)
            tokens = int(reply.usage.completion_tokens)
            texts = [c.message.content or "" for c in choices]
        except (AttributeError, TypeError, ValueError) as e:
            raise EndpointError(f"not a chat completion: {str(reply)[:300]}") from e
        if len(choices) != n:
            raise EndpointError(f"asked for n={n} choices, got {len(choices)}")
        shares = [tokens // n + (i < tokens % n) for i in range(n)]
        return [
            {
                "problem_id": problem_id,
                "index": i,
                "text": texts[i],
                "finish_reason": c.finish_reason,
                "stats": {"new_tokens": shares[i], "target_forwards": 0, "wall_s": wall_s},
            }
            for i, c in enumerate(choices)
        ]
