"""Trajectories from any OpenAI-compatible server (`tts serve`, vLLM, ...) for `jobs.evaluate
--endpoint`: one chat completion with `n` choices per item, over plain HTTP (`requests`).

The choices become trajectory records shaped like the generator actors' (`text`,
`finish_reason`, `stats`), so grading, votes and the report are the same code path. A server
reports only the total `usage.completion_tokens` of a response, so each choice is credited an
equal share of it, and nothing about forwards (acceptance length is unknown: reported as `-`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests

from tts_service.config import SamplingConfig


class EndpointError(RuntimeError):
    """The server refused a request or answered something that is not a chat completion."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the API base, e.g. http://127.0.0.1:8000/v1
    api_key: str | None = None
    timeout_s: float = 3600.0

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        url = f"{self.url.rstrip('/')}/{path}"
        try:
            r = requests.request(
                method, url, json=body, headers=self._headers(), timeout=self.timeout_s
            )
        except requests.RequestException as e:
            raise EndpointError(f"{url}: {e}") from e
        if r.status_code != 200:
            raise EndpointError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def model(self) -> str:
        """The first model the server lists (GET /models): what the run is named after."""
        data = self._call("GET", "models").get("data") or []
        if not data:
            raise EndpointError(f"{self.url}/models lists no model")
        return data[0]["id"]

    def trajectories(
        self, model: str, prompt: str, n: int, sampling: SamplingConfig, problem_id: str
    ) -> list[dict]:
        """The item's `n` trajectories as records (`index`, `text`, `finish_reason`, `stats`)."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
            "seed": sampling.seed,
        }
        start = time.perf_counter()
        reply = self._call("POST", "chat/completions", body)
        wall_s = time.perf_counter() - start
        try:
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            tokens = int(reply["usage"]["completion_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise EndpointError(f"not a chat completion: {str(reply)[:300]}") from e
        if len(choices) != n:
            raise EndpointError(f"asked for n={n} choices, got {len(choices)}")
        shares = [tokens // n + (i < tokens % n) for i in range(n)]
        return [
            {
                "problem_id": problem_id,
                "index": i,
                "text": c["message"]["content"] or "",
                "finish_reason": c["finish_reason"],
                "stats": {"new_tokens": shares[i], "target_forwards": 0, "wall_s": wall_s},
            }
            for i, c in enumerate(choices)
        ]
