"""The Ray Serve application: FastAPI ingress over one engine per replica.

(No `from __future__ import annotations` here: FastAPI must see the real `Request` type
through Serve's ingress wrapper, or it reads `request` as a query parameter.)

Routes: POST /v1/chat/completions and /v1/completions (OpenAI shapes, `stream` as server-sent
events, plus `spec_method`, `aggregate: "majority"` and `task`), POST /v1/solve (best-of-N
with the vote), GET /v1/models and /v1/models/{id}, GET /metrics (Prometheus, the whole app's
counts: metrics.py), GET /healthz, and vLLM's tokenizer routes (POST /tokenize, /detokenize,
GET /tokenizer_info: what lm-eval's remote tokenizer uses). Started by `serve run
configs/serve.yaml` or `tts serve`.
A replica's requests share one continuously batched runner: a short request joins the running
batch at the next step instead of waiting for a long one to finish. A replica holds at most
`max_queued_requests` requests (429 beyond; the `tts_queue_depth` gauge shows them); a
request running past `request_timeout_s` gets 504; a client that disconnects or times out
cancels its work at the next decoding step.
"""

import asyncio
import contextlib
import hmac
import itertools
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tts_service.schemas import ServeConfig
from tts_service.serve.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SolveHttpRequest,
    TokenizeRequest,
    parse,
)
from tts_service.serve.engine import ServeEngine
from tts_service.serve.metrics import CONTENT_TYPE, MetricsHub

fastapi_app = FastAPI(title="tts-service", docs_url=None, redoc_url=None)
RETRY_AFTER_S = 1  # a 429's Retry-After: requests here take seconds, a slot frees as fast


def _server_error(e: Exception) -> ApiError:
    """A request that failed on its own (its rows only: the batch went on without them)."""
    return ApiError(500, f"generation failed: {e}", None, "server_error")


@fastapi_app.exception_handler(ApiError)
async def _api_error(_: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        ApiError(err.status_code, str(err.detail), None, kind).body(), status_code=err.status_code
    )


class BearerAuth:
    """ASGI middleware: with `api_key` in the config (vLLM's --api-key), every route requires
    `Authorization: Bearer KEY`, else 401. Pure ASGI, so streaming and disconnects pass as is."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        key = getattr(scope["app"].state, "api_key", None) if scope["type"] == "http" else None
        if key is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                err = ApiError(401, "missing or wrong API key", "authorization", "auth_error")
                response = JSONResponse(
                    err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


fastapi_app.add_middleware(BearerAuth)


class AccessLog:
    """ASGI middleware, the outermost (refusals included): one line per request, as vLLM prints
    them: client, method and path, status, seconds to the response's start (a stream ends
    later). Pure ASGI, so streaming and disconnects pass as is."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not getattr(scope["app"].state, "access_log", True):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()

        async def send_noting_status(message) -> None:
            if message["type"] == "http.response.start":
                client = scope["client"][0] if scope.get("client") else "-"
                print(
                    f'tts: {client} "{scope["method"]} {scope["path"]}" {message["status"]} '
                    f"{time.monotonic() - started:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
            await send(message)

        await self.app(scope, receive, send_noting_status)


fastapi_app.add_middleware(AccessLog)  # added last: the outermost


JSON_BODIES = ("application/json", "application/x-www-form-urlencoded")
"""Content types read as JSON: `curl -d` sends the second by default (vLLM reads it as JSON)."""


async def _body(request: Request, cfg: ServeConfig) -> bytes:
    """The request's body, within `max_body_bytes` (413) and `body_timeout_s` (408: a client
    that sends its headers and then too little holds a Serve slot only that long)."""
    limit = cfg.max_body_bytes
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if kind.lower() not in JSON_BODIES:
        raise ApiError(415, f"Content-Type must be application/json, not {kind!r}", "body")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes", "body")
    try:
        raw = await asyncio.wait_for(request.body(), cfg.body_timeout_s)
    except TimeoutError as e:
        raise ApiError(
            408,
            f"request body not received within body_timeout_s = {cfg.body_timeout_s:g} s",
            "body",
            "timeout",
            {"Connection": "close"},
        ) from e
    if len(raw) > limit:
        raise ApiError(413, f"request body over {limit} bytes", "body")
    return raw


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(0.25)


def _status(result: dict) -> int:
    """A finished request's status in the metrics: nginx's 499 when the client went away (the
    engine's result is then empty)."""
    return 200 if result else 499


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        async with contextlib.aclosing(chunks):  # closing it sets the cancel flag at once
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except ApiError as e:  # headers are sent: report in-band, as OpenAI does
                yield f"data: {json.dumps(e.body())}\n\n"
            except Exception as e:
                err = _server_error(e)
                yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@serve.deployment
@serve.ingress(fastapi_app)
class TTSServer:
    """Duties: validate requests, queue them for the replica's engine, run them off the event
    loop, stream or return OpenAI-shaped results, and count metrics."""

    def __init__(self, cfg: dict, hub: DeploymentHandle) -> None:
        self.cfg = ServeConfig.model_validate(cfg)
        fastapi_app.state.api_key = self.cfg.api_key  # BearerAuth checks it on every route
        fastapi_app.state.access_log = self.cfg.log_level != "error"
        self.engine = ServeEngine(self.cfg)
        # one thread per admitted request: each waits on the shared runner, none queues here
        self.pool = ThreadPoolExecutor(self.cfg.max_queued_requests, "tts-request")
        self.inflight = 0
        self.replica, self.reports = uuid.uuid4().hex, itertools.count(1)  # depth reports
        self.hub = hub  # the app's metrics, shared by every replica
        self.counting: set[asyncio.Task] = set()  # 499s being counted (references kept)

    def check_health(self) -> None:
        """Serve's health probe: a tensor-parallel replica whose rank died is unhealthy, so
        Serve replaces it as a whole (its other ranks are its own actors: they go with it)."""
        if self.engine.tp is not None and self.engine.tp.dead():
            raise RuntimeError("a tensor-parallel rank of this replica died")

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: the global store's final flush (none
        for a replica whose constructor failed)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    async def _count(
        self,
        route: str,
        status: int,
        started: float,
        usage: dict | None = None,
        trajectories: list[dict] = (),
    ) -> None:
        """Report a finished request to the hub (awaited: /metrics shows it by the time the
        client has its answer). `trajectories`: the `stats` entries of each."""
        acceptance = [t["stats"]["acceptance_length"] for t in trajectories]
        await self.hub.record.remote(route, status, time.monotonic() - started, usage, acceptance)

    def _count_gone(self, route: str, started: float) -> None:
        """Count a request whose client went away (499) from a handler being cancelled: in a
        task of its own, which the cancellation does not reach."""
        task = asyncio.get_running_loop().create_task(self._count(route, 499, started))
        self.counting.add(task)
        task.add_done_callback(self.counting.discard)

    def _admit(self) -> None:
        """Count a request in, or refuse it (429) when the replica holds its maximum."""
        if self.inflight >= self.cfg.max_queued_requests:
            raise ApiError(
                429,
                f"server busy: {self.inflight} requests in flight "
                f"(max_queued_requests = {self.cfg.max_queued_requests}); retry later",
                None,
                "rate_limit_exceeded",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        self.inflight += 1
        self._report_depth()

    def _release(self) -> None:
        self.inflight -= 1
        self._report_depth()

    def _report_depth(self) -> DeploymentResponse:
        """This replica's requests now, to the hub (absolute: `Metrics.report_depth`)."""
        return self.hub.queue.remote(self.replica, next(self.reports), self.inflight)

    async def _run(self, fn, job, cancel: threading.Event, *extra):
        """Run blocking engine work (admitted by `_admit`) in its own thread.

        The request is counted out when its thread finishes, not when it is cancelled or times
        out: those set `cancel`, and the runner drops its rows at the next decoding step."""
        work = asyncio.get_running_loop().run_in_executor(self.pool, fn, job, cancel, *extra)
        work.add_done_callback(lambda _: self._release())
        timeout = self.cfg.request_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(work), timeout)
        except TimeoutError as e:
            cancel.set()
            raise ApiError(
                504, f"request exceeded request_timeout_s = {timeout:g} s; stopped", None, "timeout"
            ) from e
        except asyncio.CancelledError:
            cancel.set()
            raise

    @fastapi_app.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "model": self.engine.served_name}

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [self.engine.model_card()]}

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict:
        self.engine.check_model(model_id)
        return {**self.engine.model_card(), "id": model_id}

    @fastapi_app.get("/tokenizer_info")
    async def tokenizer_info(self) -> dict:
        return self.engine.tokenizer_info()

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> dict:
        raw = await _body(request, self.cfg)
        return self.engine.tokenize(parse(TokenizeRequest, raw))

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict:
        raw = await _body(request, self.cfg)
        return self.engine.detokenize(parse(DetokenizeRequest, raw))

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        """The app's metrics (the hub's), and the rows decoding now in the replica that
        answers (vLLM's num_requests_running, per replica)."""
        await self._report_depth()  # so the depth read is at least this replica's now
        rows = (
            "# HELP tts_rows_running Rows in the answering replica's decoding batch now.\n"
            "# TYPE tts_rows_running gauge\n"
            f"tts_rows_running {self.engine.host.rows_running()}\n"
        )
        return Response(await self.hub.text.remote() + rows.encode(), media_type=CONTENT_TYPE)

    async def _complete(self, request: Request, route: str, model_cls) -> object:
        started = time.monotonic()
        try:
            raw = await _body(request, self.cfg)
            req = parse(model_cls, raw, strict=self.cfg.reject_unknown_fields)
            job = self.engine.prepare(req)
            self._admit()
            cancel = threading.Event()
            if req.stream:  # counted when its decoding ends
                return _sse(self._stream(job, cancel, route, started))
            result = await self._run_watched(request, self.engine.complete, job, cancel)
        except ApiError as e:
            await self._count(route, e.status, started)
            raise
        except asyncio.CancelledError:  # the client went away: Serve cancels its handler
            self._count_gone(route, started)
            raise
        except Exception as e:  # the request's own failure: a counted 500, never a bare one
            await self._count(route, 500, started)
            raise _server_error(e) from e
        trajectories = result.get("tts", {}).get("trajectories", [])
        await self._count(route, _status(result), started, result.get("usage"), trajectories)
        return result

    async def _run_watched(self, request: Request, fn, job, cancel: threading.Event):
        """Run `fn(job, cancel)`, setting `cancel` if the client disconnects meanwhile."""
        watcher = asyncio.create_task(_watch_disconnect(request, cancel))
        try:
            return await self._run(fn, job, cancel)
        finally:
            cancel.set()
            watcher.cancel()

    def _stream(self, job, cancel: threading.Event, route: str, started: float):
        """Start decoding now (the request is admitted and counted out when it ends, even if
        the client never reads) and return its chunks."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(chunk: dict | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        async def decode() -> None:
            status, usage = 200, None
            try:
                usage = await self._run(self.engine.stream, job, cancel, emit)
                if cancel.is_set():  # set before the end only by the client leaving
                    status = 499
            except ApiError as e:
                status = e.status
                raise
            except Exception:  # reported in-band as a 500
                status = 500
                raise
            finally:  # before the stream's [DONE]
                await self._count(route, status, started, usage)

        task = asyncio.ensure_future(decode())

        async def chunks() -> AsyncIterator[dict]:
            try:
                while (chunk := await queue.get()) is not None:
                    yield chunk
                await task  # a timeout (504) is reported in-band
            finally:  # the client went away: stop decoding at the next step
                cancel.set()

        return chunks()

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, "chat", ChatCompletionRequest)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, "completions", CompletionRequest)

    @fastapi_app.post("/v1/solve")
    async def solve(self, request: Request):
        started = time.monotonic()
        try:
            req = parse(SolveHttpRequest, await _body(request, self.cfg))
            job = self.engine.prepare_solve(req)
            self._admit()
            result = await self._run_watched(request, self.engine.solve, job, threading.Event())
        except ApiError as e:
            await self._count("solve", e.status, started)
            raise
        except asyncio.CancelledError:
            self._count_gone("solve", started)
            raise
        except Exception as e:
            await self._count("solve", 500, started)
            raise _server_error(e) from e
        trajectories = result.get("stats", {}).get("trajectories", [])
        await self._count("solve", _status(result), started, result.get("usage"), trajectories)
        return result


def replica_bundles(cfg: ServeConfig) -> list[dict[str, float]]:
    """A tensor-parallel replica's placement bundles, one per rank, all on one node."""
    gpu = {"GPU": 1} if cfg.model.device.startswith("cuda") else {}
    return [{"CPU": cfg.cpus_per_replica, **gpu}] * cfg.tensor_parallel


def build_app(cfg: ServeConfig):
    """ServeConfig -> a bound Serve application (replicas, autoscaling, CPUs from config), with
    the one metrics hub they share."""
    # every request reaches a replica, which runs it, queues it for its runner (fair
    # admission) or answers 429 at once: Serve's default (5 ongoing) kept the rest in its
    # proxy, unbounded, and the batch at about 5 rows. Serve's own queue, past that, is
    # bounded too (503), far enough out that a refusal is the replica's 429
    ongoing = 2 * cfg.max_queued_requests + 8
    options: dict = {
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica},
        # a replica that cannot start (the model does not load) fails the deployment at once,
        # reported once, instead of Serve retrying it for a minute; a later replica's failure
        # (after one has run) is replaced as always
        "max_constructor_retry_count": 1,
        "max_ongoing_requests": ongoing,
        "max_queued_requests": 2 * ongoing,
    }
    if cfg.tensor_parallel > 1:  # the replica is rank 0, in bundle 0; its other ranks follow
        bundles = replica_bundles(cfg)
        options["ray_actor_options"] |= {"num_gpus": 1} if "GPU" in bundles[0] else {}
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = "STRICT_PACK"
    if cfg.autoscaling:
        options["autoscaling_config"] = cfg.autoscaling
    else:
        options["num_replicas"] = cfg.num_replicas
    logs = serve_logging(cfg.log_level)
    hub = MetricsHub.options(logging_config=logs).bind()
    return TTSServer.options(**options, logging_config=logs).bind(cfg.model_dump(mode="json"), hub)


def serve_logging(level: str) -> dict:
    """Serve's logging config for `level`: its per-call access lines only at info and below."""
    return {"log_level": level.upper(), "enable_access_log": level in ("debug", "info")}


def app_builder(args: dict):
    """Entry for `serve run configs/serve.yaml` (its `args` are ServeConfig fields)."""
    return build_app(ServeConfig.model_validate(args))
