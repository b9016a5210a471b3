"""The endpoint client against a small real HTTP server that speaks the OpenAI chat format: the
request it sends (n, sampling, bearer token) and the records it makes of the reply."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jobs.endpoint import Endpoint, EndpointError
from tts_service.config import SamplingConfig


class _Server(BaseHTTPRequestHandler):
    seen: list[tuple[str, dict, dict]] = []
    choices = 3
    failures: list[int] = []  # statuses to answer first, one per request

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._reply(200, {"object": "list", "data": [{"id": "served", "object": "model"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, body, dict(self.headers)))
        if self.failures:
            status = self.failures.pop(0)
            return self._reply(status, {"error": {"message": f"transient {status}"}})
        if self.headers.get("Authorization") != "Bearer k1":
            return self._reply(401, {"error": {"message": "bad key"}})
        choices = [
            {"index": i, "message": {"role": "assistant", "content": f"x={i}"}, "finish_reason": r}
            for i, r in zip(range(self.choices), ("stop", "length", "stop"), strict=False)
        ]
        self._reply(200, {"choices": choices[::-1], "usage": {"completion_tokens": 10}})

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Server.seen, _Server.choices, _Server.failures = [], 3, []
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_one_request_with_n_becomes_n_trajectory_records(server):
    endpoint = Endpoint(server, api_key="k1")
    assert endpoint.model() == "served"
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=32, seed=5)
    records = endpoint.trajectories("served", "What is 2+3?", 3, sampling, "q1")
    ((path, body, headers),) = _Server.seen
    assert path == "/v1/chat/completions"
    assert {k.lower(): v for k, v in headers.items()}["authorization"] == "Bearer k1"
    assert body == {
        "model": "served",
        "messages": [{"role": "user", "content": "What is 2+3?"}],
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "seed": 5,
    }
    assert [(r["index"], r["text"], r["finish_reason"]) for r in records] == [
        (0, "x=0", "stop"),
        (1, "x=1", "length"),
        (2, "x=2", "stop"),
    ]
    assert [r["stats"]["new_tokens"] for r in records] == [4, 3, 3]  # 10 shared out
    assert all(r["stats"]["target_forwards"] == 0 and r["problem_id"] == "q1" for r in records)


def test_refusals_and_short_replies_are_errors(server):
    sampling = SamplingConfig()
    with pytest.raises(EndpointError, match="HTTP 401"):
        Endpoint(server, api_key="wrong").trajectories("served", "q", 3, sampling, "q1")
    _Server.choices = 2
    with pytest.raises(EndpointError, match="n=3"):
        Endpoint(server, api_key="k1").trajectories("served", "q", 3, sampling, "q1")
    with pytest.raises(EndpointError, match="127.0.0.1:9"):
        Endpoint("http://127.0.0.1:9/v1").model()


def test_transient_errors_are_retried_with_backoff_and_refusals_are_not(server):
    sampling = SamplingConfig()
    _Server.failures = [503, 429, 502]  # a restarting server, then a busy one
    records = Endpoint(server, api_key="k1").trajectories("served", "q", 3, sampling, "q1")
    assert len(records) == 3 and len(_Server.seen) == 4  # three retries, then the answer
    _Server.seen, _Server.failures = [], [400]
    with pytest.raises(EndpointError, match="HTTP 400"):
        Endpoint(server, api_key="k1").trajectories("served", "q", 3, sampling, "q1")
    assert len(_Server.seen) == 1  # a refusal is final
    _Server.seen, _Server.failures = [], [503] * 3
    with pytest.raises(EndpointError, match="HTTP 503"):
        Endpoint(server, api_key="k1", retries=2).trajectories("served", "q", 3, sampling, "q")
    assert len(_Server.seen) == 3  # the first try and two retries
