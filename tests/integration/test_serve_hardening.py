"""The Serve app under attack, over real HTTP on loopback: hostile bodies, loose types,
parameters we do not implement, a request that would hold the replica, a full queue, a
deadline, and a client that goes away. Each test performs the attack; none asserts speed."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from store.local_server import free_port
from tests.integration.test_serve_metrics import scrape
from tts_service.schemas import ServeConfig

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 4, "seed": 1}
LONG = {"messages": [{"role": "user", "content": "go"}], "n": 16, "max_tokens": 300}
# work far past the tight app's 2 s deadline on any machine: LONG itself took 2.2-3.3 s on a
# quiet machine here (and finished inside the deadline once); this 12 s
PAST_DEADLINE = {**LONG, "n": 64, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(ray_local, tiny_model_dir):
    """Two apps on one Serve instance: the defaults in strict mode (an unknown field is a 400),
    and one with a 1-request queue, a 2 s deadline and 1 s for a body to arrive."""
    from ray import serve

    from tts_service.serve.app import build_app

    model = {"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(
            ServeConfig(
                model=model, cpus_per_replica=0.5, max_tokens_cap=400, reject_unknown_fields=True
            )
        ),
        name="tts-hard",
        route_prefix="/open",
    )
    tight = ServeConfig(
        model=model,
        cpus_per_replica=0.5,
        max_tokens_cap=400,
        max_queued_requests=1,
        request_timeout_s=2.0,
        body_timeout_s=1.0,
    )
    serve.run(build_app(tight), name="tts-tight", route_prefix="/tight")
    base = f"http://127.0.0.1:{port}"
    yield f"{base}/open", f"{base}/tight"
    serve.delete("tts-hard")
    serve.delete("tts-tight")
    serve.shutdown()


def call(url: str, body=None, raw: bytes | None = None, kind: str = "application/json"):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": kind})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def call_with_headers(url: str, body: dict):
    """(status, text, headers: read case-insensitively, as HTTP names them)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


POISON = [  # each must be a 400 and touch nobody else's request
    b'{"prompt": [-1], "max_tokens": 4}',
    b'{"prompt": [-3, 5, 6], "max_tokens": 4}',
    b'{"prompt": [5, 6, 100000000], "max_tokens": 4}',
    b'{"prompt": [[5, 6], [-7]], "max_tokens": 4}',
    b'{"prompt": [], "max_tokens": 4}',
    b'{"prompt": "\\ud800", "max_tokens": 4}',
    b'{"prompt": ["ok", "\\udfff"], "max_tokens": 4}',
]


def test_poison_requests_are_400s_and_their_neighbours_decode_as_alone(servers):
    """Bad prompts sent while good requests decode: each bad one is a 400 naming `prompt`,
    every good one is a 200 with the greedy tokens it gets alone."""
    base, _ = servers
    good = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 24, "temperature": 0}
    status, alone = call(base + "/v1/completions", good)
    assert status == 200, alone
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(call, base + "/v1/completions", good) for _ in range(6)]
        bads = [pool.submit(call, base + "/v1/completions", None, raw) for raw in POISON * 2]
        for bad in bads:
            status, text = bad.result()
            assert status == 400 and _openai_error(text)["param"] == "prompt", text
        for g in goods:
            status, text = g.result()
            assert status == 200, text
            assert json.loads(text)["choices"][0]["text"] == json.loads(alone)["choices"][0]["text"]


def _openai_error(text: str) -> dict:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


BAD_VALUES = {
    "n": ["4", True, 0, -3, 65, 1.5, None, [], {}],
    "temperature": ["hot", "0.5", True, -1, 3, None, [], float("inf")],
    "top_p": [0, 1.5, "x", False, None],
    "top_k": [-2, "3", 1.5, True, None],
    "min_p": [-0.1, 2, "0", False, None],
    "max_tokens": [True, 0, -5, "8", 10**9, 2.5, []],
    "stop": [5, [1], [""], ["a"] * 5, {"a": 1}],
    "seed": [-1, 2**70, "1", True, 1.5],
    "stream": ["yes", 1, None, []],
    "messages": [[], "hi", [{"role": "alien", "content": "x"}], [{"role": "user"}]]
    + [[{"role": "user", "content": 5}], [{"content": "x"}], None, [{"role": "user", "x": 1}]],
    "spec_method": ["medusa", 5, True],
    "aggregate": ["mean", True],
    "task": ["poetry", 1],
    "model": ["gpt-9", 5],
    "user": [5, ["a"]],
    "logprobs": ["yes", -1, 21],
    "top_logprobs": [5, "1", 21],
    "presence_penalty": [0.5, -1, "0"],
    "frequency_penalty": [1, False],
    "logit_bias": [{"1": 5}],
    "best_of": [2],
    "echo": ["yes", 1],
    "suffix": ["x"],
    "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, {"x": 1}, True],
    "tools": [[{"type": "function"}]],
    "response_format": [{"type": "json_object"}],
    "foo": [1],
    "bar_baz": ["x"],
}
RAW = [
    b"[" * 2000,
    b'{"a":' * 2000 + b"1" + b"}" * 2000,
    b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b"{not json",
    b"",
    b"[]",
    b'"chat"',
    b"42",
    b"null",
    b"\xff\xfe\xfd",
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "n": 1e999}',
    b'{"messages": [{"role": "user", "content": "x"}]',
]


def _hostile() -> list[tuple[str, bytes, str]]:
    """(route, body, content type): each one malformed."""
    out = []
    for field, values in BAD_VALUES.items():
        for v in values:
            out.append(("/v1/chat/completions", {**CHAT, field: v}))
            if field != "messages":
                prompt = {"prompt": "2 + 2 =", "max_tokens": 4}
                out.append(("/v1/completions", {**prompt, field: v}))
    for q in ["", 5, None, ["x"]]:
        out.append(("/v1/solve", {"question": q}))
    for field, v in [("n", "4"), ("n", 0), ("seed", True), ("return_trajectories", "yes")]:
        out.append(("/v1/solve", {"question": "2 + 2?", field: v}))
    out.append(("/v1/solve", {"question": "2 + 2?", "logprobs": True}))
    reqs = [(route, json.dumps(b).encode(), "application/json") for route, b in out]
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/solve"]
    for route, raw in itertools.product(routes, RAW):
        reqs.append((route, raw, "application/json"))
    for kind in ["text/plain", "multipart/form-data"]:  # curl -d's form type is read as JSON
        reqs.append(("/v1/chat/completions", json.dumps(CHAT).encode(), kind))
    return reqs


def test_200_hostile_requests_all_get_4xx_then_a_valid_one_succeeds(servers):
    base, _ = servers
    hostile = _hostile()
    assert len(hostile) >= 200
    for route, raw, kind in hostile:
        status, text = call(base + route, raw=raw, kind=kind)
        assert 400 <= status < 500, (route, raw[:80], kind, status, text[:200])
        _openai_error(text)
    status, text = call(base + "/v1/chat/completions", CHAT)
    assert status == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "raw", [b"[" * 2000, b'{"a":' * 2000 + b"1" + b"}" * 2000], ids=["arrays", "objects"]
)
def test_deeply_nested_json_is_a_400_not_a_500(servers, raw):
    status, text = call(servers[0] + "/v1/completions", raw=raw)
    assert status == 400 and _openai_error(text)["param"] == "body"


@pytest.mark.parametrize(
    "field,value", [("n", "4"), ("max_tokens", True), ("stream", "yes"), ("seed", "1")]
)
def test_loose_types_are_refused_not_coerced(servers, field, value):
    status, text = call(servers[0] + "/v1/chat/completions", {**CHAT, field: value})
    assert status == 400 and _openai_error(text)["param"] == field


def test_a_text_plain_body_is_refused_and_curl_s_default_type_is_read_as_json(servers):
    status, text = call(servers[0] + "/v1/chat/completions", CHAT, kind="text/plain")
    assert status == 415 and "application/json" in _openai_error(text)["message"]
    form = "application/x-www-form-urlencoded"  # what `curl -d '{...}'` sends
    status, text = call(servers[0] + "/v1/chat/completions", CHAT, kind=form)
    assert status == 200 and json.loads(text)["object"] == "chat.completion", text


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 0.5),
        ("logit_bias", {"1": 5}),
        ("presence_penalty", 0.5),
        ("best_of", 3),
    ],
)
def test_unimplemented_parameters_are_named_unless_they_ask_for_nothing(servers, field, value):
    status, text = call(servers[0] + "/v1/chat/completions", {**CHAT, field: value})
    assert status == 400 and _openai_error(text)["param"] == field
    neutral = {"frequency_penalty": 0, "logit_bias": {}, "presence_penalty": 0.0, "best_of": 1}
    status, text = call(servers[0] + "/v1/chat/completions", {**CHAT, field: neutral[field]})
    assert status == 200, text


def test_a_short_request_is_not_starved_by_a_long_one(servers):
    """A 16 x 400-token request fills the batch; a 4-token request sent once the long one is
    decoding is done before any of the long one's choices ends: it joins the running batch
    instead of waiting for a row to free. The long one streams, so "decoding" is its first
    token and "ends" its first finish chunk, not guesses (a fixed sleep raced the tiny model,
    which decodes the whole long request in about a second)."""
    base, _ = servers
    decoding, long_finishing = threading.Event(), threading.Event()
    results: dict = {}

    def long_request():
        body = {**LONG, "max_tokens": 400, "temperature": 0.8, "stream": True}
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    if choice["delta"].get("content"):
                        decoding.set()
                    if choice["finish_reason"] is not None:
                        long_finishing.set()
            results["long"] = r.status

    worker = threading.Thread(target=long_request)
    worker.start()
    assert decoding.wait(timeout=120), "the long request never started decoding"
    status, text = call(base + "/v1/chat/completions", CHAT)
    short_first = not long_finishing.is_set()
    worker.join(timeout=600)
    assert status == 200 and results["long"] == 200, text
    assert short_first


def test_a_full_queue_is_429_and_the_deadline_is_504(servers):
    _, tight = servers
    results: dict = {}

    def long_request():  # sent until admitted: a probe below may hold the one place
        while (reply := call(tight + "/v1/chat/completions", PAST_DEADLINE))[0] == 429:
            time.sleep(0.01)
        results["long"] = reply

    worker = threading.Thread(target=long_request)
    worker.start()
    refused = None
    for _ in range(200):  # the long request is admitted within moments; then the queue is full
        status, text, headers = call_with_headers(
            tight + "/v1/completions", {"prompt": "hi", "max_tokens": 1}
        )
        if status == 429:
            refused = _openai_error(text)
            assert int(headers.get("Retry-After", "0")) >= 1, dict(headers)
            break
        time.sleep(0.05)
    worker.join(timeout=300)
    assert refused is not None and "max_queued_requests" in refused["message"]
    status, text = results["long"]
    assert status == 504 and "request_timeout_s" in _openai_error(text)["message"]
    for _ in range(100):  # the timed-out work stops at its next step and leaves the queue
        status, text = call(tight + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        if status == 200:
            break
        assert status in (429, 504), text  # still leaving, or a busy box: nothing else
        time.sleep(0.1)
    assert status == 200, text
    counted = scrape(tight)  # the refusals and the deadline are in the app's metrics
    assert counted[("tts_requests_total", (("route", "chat"), ("status", "504")))] == 1
    assert counted[("tts_requests_total", (("route", "completions"), ("status", "429")))] >= 1


def test_a_client_gone_stops_the_rest_of_an_n_gt_1_request(tiny_model_dir):
    """In-process: once the request is cancelled, its remaining rows leave at the next step."""
    from tts_service.serve.api import ChatCompletionRequest
    from tts_service.serve.engine import ServeEngine

    cfg = ServeConfig(model={"name": str(tiny_model_dir), "device": "cpu"}, max_tokens_cap=400)
    engine = ServeEngine(cfg)
    job = engine.prepare(ChatCompletionRequest.model_validate({**LONG, "n": 8}))
    decoder = engine.host.runner.decoder
    cancel, out = threading.Event(), {}
    worker = threading.Thread(target=lambda: out.setdefault("r", engine.complete(job, cancel)))
    worker.start()
    while decoder.forwards.forwards < 3:
        time.sleep(0.005)
    cancel.set()
    at_cancel = decoder.forwards.forwards
    worker.join(timeout=120)
    assert out["r"] == {} and decoder.forwards.forwards <= at_cancel + 2
    assert not decoder.active  # every row of the request left the batch


def _rows_running(base: str) -> float:
    return scrape(base)[("tts_rows_running", ())]


def _499s(base: str) -> float:
    counted = scrape(base).items()
    return sum(
        v
        for (name, labels), v in counted
        if name == "tts_requests_total" and ("status", "499") in labels
    )


@pytest.mark.parametrize("route", ["chat", "chat-stream", "solve"])
def test_a_client_that_leaves_mid_generation_stops_its_rows_and_is_counted_499(servers, route):
    """Over real HTTP through Serve's proxy: the client closes its socket while its rows
    decode; the rows leave the batch (read from the replica, not from CPU use) and the request
    is counted as nginx's 499 (an abandoned request that decoded to its end would count as
    200)."""
    import http.client
    from urllib.parse import urlparse

    base, _ = servers
    before = _499s(base)
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    stream = route == "chat-stream"
    body = {**LONG, "n": 64, "max_tokens": 400, "temperature": 0.8, "stream": stream}
    path = "/v1/chat/completions"
    if route == "solve":
        path, body = "/v1/solve", {"question": "go", "n": 64, "max_tokens": 400}
    conn.request("POST", url.path + path, json.dumps(body), {"Content-Type": "application/json"})
    if stream:  # headers and a first content chunk: decoding has started
        resp = conn.getresponse()
        assert resp.status == 200
        while b'"content"' not in resp.fp.readline():
            pass
    else:
        for _ in range(600):
            if _rows_running(base) > 0:
                break
            time.sleep(0.1)
    assert _rows_running(base) > 0
    conn.sock.shutdown(2)  # the client goes away
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_rows_running(base) or _499s(base) == before):
        time.sleep(0.2)
    assert _rows_running(base) == 0
    assert _499s(base) == before + 1


def test_concurrent_requests_share_one_batch(servers):
    """24 concurrent chat requests on one replica decode together: the batch reaches at least
    12 rows (Serve's default of 5 ongoing requests per replica held it at about 5)."""
    base, _ = servers
    body = {**CHAT, "max_tokens": 400, "temperature": 0.8}
    most, done = 0, threading.Event()

    def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, _rows_running(base))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda _: call(base + "/v1/chat/completions", body), range(24)))
    done.set()
    watcher.join()
    assert all(status == 200 for status, _ in replies), replies[0]
    assert most >= 12


def _half_sent(url: str, text: str) -> socket.socket:
    """A connection that sent `text` (part of a request) and then nothing."""
    where = urllib.parse.urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=60)
    sock.sendall(text.encode())
    return sock


def test_a_body_that_never_arrives_is_408_and_holds_no_slot(servers):
    _, tight = servers
    url = f"{tight}/v1/chat/completions"
    path = urllib.parse.urlsplit(url).path
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # more than the app's Serve slots (2 * max_queued_requests + 8 = 10): without a bound on
    # the body, the request below would wait behind them for as long as they stay
    slow = [_half_sent(url, head + 'Content-Length: 200\r\n\r\n{"messages": ') for _ in range(14)]
    try:
        status, text = call(url, CHAT)
        assert status == 200, text
        for sock in slow:  # each answered within the socket's 60 s (its bound is 1 s)
            reply = b"".join(iter(lambda s=sock: s.recv(4096), b"")).decode()  # to its close
            assert reply.startswith("HTTP/1.1 408"), reply
            assert "body_timeout_s = 1 s" in reply
    finally:
        for sock in slow:
            sock.close()


def test_clients_that_never_finish_their_headers_hold_no_slot(servers):
    _, tight = servers
    url = f"{tight}/v1/chat/completions"
    stalled = [_half_sent(url, "POST /tight/v1/chat/completions HTTP/1.1\r\nHo") for _ in range(50)]
    try:
        status, text = call(url, CHAT)
        assert status == 200, text
    finally:
        for sock in stalled:
            sock.close()
