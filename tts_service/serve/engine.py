"""What one Serve replica does with a validated request: a plain class, testable without Serve.

It checks what pydantic cannot (the model name, caps from the config, the model's context),
turns requests into engine calls, and shapes OpenAI responses with our extension field `tts`
(the speculative method, every trajectory's counters, and the vote when asked).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import TypeAdapter

from store.base import NgramStore
from store.factory import open_global_store, open_problem_store, problem_id
from store.redis_store import StoreUnavailableError
from tts_service.aggregate import Task, extract_answer, majority_vote
from tts_service.config import (
    DrafterConfig,
    SamplingConfig,
    ServeConfig,
    default_max_rows,
)
from tts_service.drafters.methods import method_drafter
from tts_service.generation import Generator, InputTooLongError
from tts_service.runner import (
    RunnerLoop,
    RunReport,
    TrajectoryRequest,
    TrajectoryResult,
    TrajectoryRunner,
)
from tts_service.serve.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SolveHttpRequest,
    new_id,
    now,
)

_DRAFTER = TypeAdapter(DrafterConfig)
HttpRequest = CompletionRequest | ChatCompletionRequest | SolveHttpRequest


class Cancelled(Exception):
    """The client went away."""


@dataclass(frozen=True)
class Job:
    """A validated request, ready to run: what the routes hand the engine."""

    chat: bool
    prompt_ids: list[int]
    n: int
    sampling: SamplingConfig
    method: str
    drafter: DrafterConfig
    aggregate: bool
    task: Task
    return_trajectories: bool = False  # /v1/solve: the texts and answers with the vote
    include_usage: bool = False  # a stream's last chunk carries `usage`

    def usage(self, completion_tokens: int) -> dict:
        """OpenAI's `usage`: the prompt counts once, whatever n."""
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }


class ServeEngine:
    """With `tensor_parallel` G > 1 this process is rank 0 of G (`actors.tp`): its steps share
    a fixed token budget and GT-sized methods a fixed GPU-like verify cost (a measurement would
    time forwards the other ranks do not mirror)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.tp = None
        if cfg.tensor_parallel > 1:
            from actors.tp import TensorParallelLeader

            self.tp = TensorParallelLeader(cfg.model, cfg.tensor_parallel, cfg.cpus_per_replica)
            self.generator = self.tp.generator
        else:
            self.generator = Generator.load(cfg.model)
        self.served_name = cfg.served_model_name or cfg.model.name
        self.created = now()
        self.store_url = cfg.store.url
        self.global_store = open_global_store(cfg.store, self.store_url)
        max_rows = cfg.max_rows or default_max_rows(str(self.generator.loaded.device))
        # concurrent requests share the batch; a short one joins while a long one decodes
        if self.tp is not None:
            runner = TrajectoryRunner(
                self.generator, max_rows, "fixed", admission="fair", decoder=self.tp.decoder
            )
        else:  # the cost surface's prior (or the one kept on disk) before the first request
            self.generator.surface(max_rows)
            runner = TrajectoryRunner(self.generator, max_rows, admission="fair")
        self.runner = RunnerLoop(runner)

    def model_card(self) -> dict:
        """The served model as OpenAI's `/v1/models` lists it."""
        return {
            "id": self.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tts-service",
        }

    # -- validation beyond the schema --------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """404 (OpenAI's shape) unless `name` is the served name or the model's own."""
        if name is not None and name not in (self.served_name, self.cfg.model.name):
            raise ApiError(
                404,
                f"model {name!r} does not exist (serving {self.served_name!r})",
                "model",
                "not_found_error",
            )

    def _drafter(self, method: str | None) -> tuple[str, DrafterConfig]:
        method = method or self.cfg.default_method
        fields = method_drafter(method, self.cfg.drafters, self.cfg.model.device)
        return method, _DRAFTER.validate_python(fields)

    def _sampling(self, req: HttpRequest) -> SamplingConfig:
        if req.n > self.cfg.max_n:
            raise ApiError(400, f"n: at most {self.cfg.max_n}", "n")
        max_new = req.max_tokens or self.cfg.default_max_tokens
        if max_new > self.cfg.max_tokens_cap:
            raise ApiError(400, f"max_tokens: at most {self.cfg.max_tokens_cap}", "max_tokens")
        return SamplingConfig(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),  # vLLM's -1 is our 0
            min_p=req.min_p,
            max_new_tokens=max_new,
            seed=secrets.randbelow(2**31) if req.seed is None else req.seed,
            stop=tuple(req.stop)
            if isinstance(req, CompletionRequest | ChatCompletionRequest)
            else (),
        )

    def _fit(self, ids: list[int], sampling: SamplingConfig, field: str) -> None:
        try:
            self.generator.check_fits(ids, sampling)
        except InputTooLongError as e:
            raise ApiError(400, f"{field}: {e}", field) from e

    def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        chat = isinstance(req, ChatCompletionRequest)
        field = "messages" if chat else "prompt"
        sampling = self._sampling(req)
        tok = self.generator.loaded.tokenizer
        if chat:
            try:
                enc = tok.apply_chat_template(
                    [m.model_dump() for m in req.messages],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )
            except Exception as e:  # the model's own template refused them: the input's fault
                raise ApiError(
                    400, f"messages: the chat template rejected them: {e}", "messages"
                ) from e
            ids = list(enc["input_ids"])
        else:
            ids = list(tok(req.prompt)["input_ids"])
        if not ids:
            raise ApiError(400, f"{field}: encodes to no tokens", field)
        self._fit(ids, sampling, field)
        method, drafter = self._drafter(req.spec_method)
        return Job(
            chat,
            ids,
            req.n,
            sampling,
            method,
            drafter,
            req.aggregate == "majority",
            req.task,
            include_usage=req.stream_options is not None and req.stream_options.include_usage,
        )

    def prepare_solve(self, req: SolveHttpRequest) -> Job:
        self.check_model(req.model)
        sampling = self._sampling(req)
        ids = self.generator.encode(req.question, chat=True)
        self._fit(ids, sampling, "question")
        method, drafter = self._drafter(req.method)
        return Job(
            True, ids, req.n, sampling, method, drafter, True, req.task, req.return_trajectories
        )

    # -- execution -----------------------------------------------------------------------
    def _store(self, job: Job) -> NgramStore:
        try:
            return open_problem_store(
                self.cfg.store, self.store_url, problem_id(job.prompt_ids), self.global_store
            )
        except StoreUnavailableError as e:
            raise ApiError(503, str(e), None, "service_unavailable") from e

    def close(self) -> None:
        """The replica's end: the global store pushes what it queued (a bounded wait); a
        tensor-parallel replica's other ranks stop."""
        if self.global_store is not None:
            self.global_store.close()
        if self.tp is not None:
            self.tp.close()

    def _requests(
        self, job: Job, store: NgramStore, cancel: threading.Event, on_commit=None
    ) -> list[TrajectoryRequest]:
        """The request's n trajectories (seeds: seed + index), each stopping at its next step
        once `cancel` is set (the client went away)."""
        return [
            TrajectoryRequest(
                "request",
                i,
                job.prompt_ids,
                job.sampling.model_copy(update={"seed": job.sampling.seed + i}),
                job.drafter,
                store,
                on_commit=(lambda _t: not cancel.is_set())
                if on_commit is None
                else (lambda t, i=i: on_commit(i, t)),
            )
            for i in range(job.n)
        ]

    def _trajectories(self, job: Job, cancel: threading.Event) -> RunReport:
        """Every trajectory of the request, in index order, through the replica's runner."""
        with contextlib.closing(self._store(job)) as store:  # the request's end is its store's
            report = self.runner.run(
                self._requests(job, store, cancel), skip=lambda _r: cancel.is_set()
            )
        if cancel.is_set():
            raise Cancelled
        report.results.sort(key=lambda r: r.request.index)
        return report

    def _extension(self, job: Job, report: RunReport) -> dict:
        outs = [r.output for r in report.results]
        ext: dict = {
            "spec_method": job.method,
            "stats": report.summary(),
            "trajectories": [{"index": i, "stats": o.stats.to_dict()} for i, o in enumerate(outs)],
        }
        if job.aggregate:
            vote = majority_vote([extract_answer(o.text, job.task) for o in outs], job.task)
            ext["aggregate"] = {
                "method": "majority",
                "answer": vote.answer,
                "votes": vote.votes,
                "share": vote.share,
                "no_answer": vote.num_no_answer,
                "winner_indices": list(vote.winner_indices),
            }
        return ext

    def complete(self, job: Job, cancel: threading.Event) -> dict:
        try:
            report = self._trajectories(job, cancel)
        except Cancelled:
            return {}
        outs = [r.output for r in report.results]
        finish = {"cancelled": "stop"}
        if job.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": o.text},
                    "finish_reason": finish.get(o.finish_reason, o.finish_reason),
                }
                for i, o in enumerate(outs)
            ]
        else:
            choices = [
                {
                    "index": i,
                    "text": o.text,
                    "logprobs": None,
                    "finish_reason": finish.get(o.finish_reason, o.finish_reason),
                }
                for i, o in enumerate(outs)
            ]
        return {
            "id": new_id("chatcmpl" if job.chat else "cmpl"),
            "object": "chat.completion" if job.chat else "text_completion",
            "created": now(),
            "model": self.served_name,
            "choices": choices,
            "usage": job.usage(sum(len(o.token_ids) for o in outs)),
            "tts": self._extension(job, report),
        }

    def stream(
        self, job: Job, cancel: threading.Event, emit: Callable[[dict | None], None]
    ) -> dict:
        """The n choices decode together; each streams as text deltas tagged with its index
        (interleaved, as OpenAI streams n > 1) and ends with its finish chunk; with
        `include_usage`, a last chunk with no choices carries `usage`; `emit(None)` ends the
        stream. Returns the usage (a cancelled stream's: the tokens it decoded)."""
        cid, created = new_id("chatcmpl" if job.chat else "cmpl"), now()
        hold = max((len(s) for s in job.sampling.stop), default=0)

        def send(choices: list[dict], **usage) -> None:
            emit(
                {
                    "id": cid,
                    "object": "chat.completion.chunk" if job.chat else "text_completion",
                    "created": created,
                    "model": self.served_name,
                    "choices": choices,
                    **usage,
                }
            )

        def chunk(index: int, text: str | None, finish: str | None, first: bool = False):
            if job.chat:
                delta = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish}
            send([choice], **({"usage": None} if job.include_usage else {}))

        ids: list[list[int]] = [[] for _ in range(job.n)]
        final: dict[int, int] = {}  # index -> its output's tokens, once it has ended
        sent = [0] * job.n

        def on_commit(i: int, tokens) -> bool:
            ids[i].extend(tokens)
            text = self.generator.decode(ids[i])
            for s in job.sampling.stop:  # never stream a stop string or what follows
                if s in text:
                    text = text[: text.index(s)]
            safe = len(text) - hold
            while safe > sent[i] and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > sent[i]:
                chunk(i, text[sent[i] : safe], None)
                sent[i] = safe
            return not cancel.is_set()

        def on_result(res: TrajectoryResult) -> None:
            i, out = res.request.index, res.output
            final[i] = len(out.token_ids)
            if len(out.text) > sent[i]:
                chunk(i, out.text[sent[i] :], None)
            chunk(i, None, "stop" if out.finish_reason == "cancelled" else out.finish_reason)

        try:
            with contextlib.closing(self._store(job)) as store:
                requests = self._requests(job, store, cancel, on_commit)
                for i in range(job.n):
                    chunk(i, None, None, first=True)
                self.runner.run(requests, on_result, skip=lambda _r: cancel.is_set())
            usage = job.usage(sum(final.get(i, len(ids[i])) for i in range(job.n)))
            if job.include_usage:
                send([], usage=usage)
            return usage
        finally:
            emit(None)

    def solve(self, job: Job, cancel: threading.Event) -> dict:
        try:
            report = self._trajectories(job, cancel)
        except Cancelled:
            return {}
        outs = [r.output for r in report.results]
        ext = self._extension(job, report)
        body = {
            "answer": ext["aggregate"]["answer"],
            "votes": ext["aggregate"]["votes"],
            "share": ext["aggregate"]["share"],
            "no_answer": ext["aggregate"]["no_answer"],
            "task": job.task,
            "n": job.n,
            "method": job.method,
            "stats": {**ext["stats"], "trajectories": ext["trajectories"]},
            "usage": job.usage(sum(len(o.token_ids) for o in outs)),
        }
        if job.return_trajectories:
            body["trajectories"] = [
                {
                    "index": i,
                    "text": o.text,
                    "finish_reason": o.finish_reason,
                    "answer": extract_answer(o.text, job.task),
                }
                for i, o in enumerate(outs)
            ]
        return body
