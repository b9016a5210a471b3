"""The app's Prometheus metrics, counted in one place for every replica.

Replicas are separate processes (on separate nodes, possibly), so none of them can answer for
the app: each sends what it counted to one `MetricsHub` replica, which keeps the only registry,
and `GET /metrics` on any replica returns the hub's text. Every route reports there: the
completions (plain and streamed), `/v1/solve` and the refused requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray import serve

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format


class Metrics:
    """The `tts_*` metrics in a registry of their own (a plain class, testable without Ray)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tts_requests", "HTTP requests", ["route", "status"], registry=r)
        self.prompt_tokens = Counter(
            "tts_prompt_tokens", "Prompt tokens (once per request)", ["route"], registry=r
        )
        self.generation_tokens = Counter(
            "tts_generation_tokens", "Generated tokens (every choice)", ["route"], registry=r
        )
        self.seconds = Histogram(
            "tts_request_seconds",
            "From a request's arrival until its answer is ready (a stream: decoded)",
            ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.acceptance = Histogram(
            "tts_acceptance_length",
            "A trajectory's tokens per target forward",
            buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0),
            registry=r,
        )
        self.queue = Gauge(
            "tts_queue_depth", "Requests running or waiting, over all replicas", registry=r
        )
        self.depths: dict[str, tuple[int, int]] = {}  # replica -> (report number, its depth)

    def report_depth(self, replica: str, seq: int, depth: int) -> None:
        """A replica's own count of its requests now, its `seq`-th report: absolute, so a
        report lost or late (a replica's calls may arrive out of order, or not at all when its
        clients leave) never leaves the sum drifting; an older report than one held is
        ignored. A replica that dies holding requests leaves them in."""
        held = self.depths.get(replica)
        if held is None or seq > held[0]:
            self.depths[replica] = (seq, max(0, depth))
        self.queue.set(sum(d for _, d in self.depths.values()))

    def record(
        self,
        route: str,
        status: int,
        seconds: float,
        usage: dict | None = None,
        acceptance: list[float] = (),
    ) -> None:
        """One finished request: its status, duration, tokens and trajectories."""
        self.requests.labels(route, str(status)).inc()
        self.seconds.labels(route).observe(seconds)
        if usage:
            self.prompt_tokens.labels(route).inc(usage["prompt_tokens"])
            self.generation_tokens.labels(route).inc(usage["completion_tokens"])
        for a in acceptance:
            self.acceptance.observe(a)

    def text(self) -> bytes:
        return generate_latest(self.registry)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class MetricsHub:
    """The app's one `Metrics`; the replicas' calls come in one at a time."""

    def __init__(self) -> None:
        self.metrics = Metrics()

    def record(self, *args, **kwargs) -> None:
        self.metrics.record(*args, **kwargs)

    def queue(self, replica: str, seq: int, depth: int) -> None:
        """A replica's requests now (`Metrics.report_depth`)."""
        self.metrics.report_depth(replica, seq, depth)

    def text(self) -> bytes:
        return self.metrics.text()
