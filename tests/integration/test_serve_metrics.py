"""`GET /metrics` on a two-replica app over real HTTP: every route's requests and tokens
(streamed and `/v1/solve` included) are counted once, whichever replica served them and
whichever replica answers the scrape."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from store.local_server import free_port
from tests.integration.test_serve import call
from tts_service.schemas import ServeConfig

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def server(ray_local, tiny_model_dir):
    from ray import serve

    from tts_service.serve.app import build_app

    port = free_port()
    cfg = ServeConfig(
        model={"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
        num_replicas=2,
        cpus_per_replica=0.5,
        max_tokens_cap=300,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="tts-metrics", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("tts-metrics")
    serve.shutdown()


def scrape(base: str) -> dict[tuple, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _streamed_usage(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(
            {**body, "stream": True, "stream_options": {"include_usage": True}}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        events = [x[6:] for x in r.read().decode().splitlines() if x.startswith("data: ")]
    return json.loads(events[-2])["usage"]


def test_every_route_counts_its_requests_and_tokens_across_replicas(server):
    def chat(seed: int) -> dict:
        status, body = call(server, "/v1/chat/completions", {**CHAT, "seed": seed, "n": 2})
        assert status == 200
        return json.loads(body)["usage"]

    with ThreadPoolExecutor(8) as pool:  # concurrent, so both replicas serve some
        chats = list(pool.map(chat, range(8)))
    streamed = [
        _streamed_usage(server, "/v1/chat/completions", {**CHAT, "seed": s}) for s in (1, 2)
    ]
    status, body = call(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 5})
    completion = json.loads(body)["usage"]
    status, body = call(
        server, "/v1/solve", {"question": "What is 3 + 4?", "n": 3, "max_tokens": 8}
    )
    assert status == 200
    solved = json.loads(body)
    assert solved["usage"]["completion_tokens"] == sum(
        t["stats"]["new_tokens"] for t in solved["stats"]["trajectories"]
    )
    assert call(server, "/v1/chat/completions", {**CHAT, "n": 0})[0] == 400

    scrapes = [scrape(server) for _ in range(6)]  # each answered by either replica
    assert all(s == scrapes[0] for s in scrapes[1:])  # one registry for the app
    s = scrapes[0]
    req = lambda route, status: s[("tts_requests_total", (("route", route), ("status", status)))]  # noqa: E731
    assert req("chat", "200") == 10 and req("chat", "400") == 1
    assert req("completions", "200") == 1 and req("solve", "200") == 1
    gen = lambda route: s[("tts_generation_tokens_total", (("route", route),))]  # noqa: E731
    prompt = lambda route: s[("tts_prompt_tokens_total", (("route", route),))]  # noqa: E731
    assert gen("chat") == sum(u["completion_tokens"] for u in chats + streamed)
    assert prompt("chat") == sum(u["prompt_tokens"] for u in chats + streamed)
    assert gen("completions") == completion["completion_tokens"]
    assert gen("solve") == solved["usage"]["completion_tokens"]
    assert prompt("solve") == solved["usage"]["prompt_tokens"]
    assert s[("tts_request_seconds_count", (("route", "chat"),))] == 11
    assert s[("tts_acceptance_length_count", ())] == 8 * 2 + 1 + 3  # every trajectory served
    assert s[("tts_queue_depth", ())] == 0


def test_queue_depth_shows_a_running_request_then_drops_back(server):
    done = threading.Event()

    def long() -> None:
        call(server, "/v1/chat/completions", {**CHAT, "max_tokens": 300, "n": 4, "seed": 9})
        done.set()

    threading.Thread(target=long, daemon=True).start()
    depths = []
    while not done.is_set():
        depths.append(scrape(server)[("tts_queue_depth", ())])
        time.sleep(0.1)
    assert max(depths) >= 1
    deadline = time.monotonic() + 30
    while scrape(server)[("tts_queue_depth", ())] != 0:  # the release is not awaited
        assert time.monotonic() < deadline
        time.sleep(0.2)
