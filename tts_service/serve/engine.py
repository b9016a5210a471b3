"""What one Serve replica does with a validated request: a plain class, testable without Serve.

It checks what pydantic cannot (the model name, caps from the config, the model's context),
turns requests into engine calls, and shapes OpenAI responses with our extension field `tts`
(the speculative method, every trajectory's counters, and the vote when asked).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import TypeAdapter

from actors.host import RunnerHost
from store.base import NgramStore
from store.factory import problem_id
from store.redis_client import StoreUnavailableError
from tts_service import startup
from tts_service.aggregate import Task, extract_answer, majority_vote
from tts_service.aggregate.confidence import labelled_vote
from tts_service.aggregate.early_stop import EarlyStop
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DrafterConfig, method_drafter
from tts_service.generation import Generator, InputTooLongError
from tts_service.runner import fair_admission
from tts_service.schemas import ServeConfig
from tts_service.serve.api import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    Prompt,
    SolveHttpRequest,
    TokenizeRequest,
    new_id,
    now,
)
from tts_service.serve.logprobs import LogprobFormat, ScoredTokens
from tts_service.textstream import StableText
from tts_service.trajectory import RunReport, TrajectoryRequest, TrajectoryResult

_DRAFTER = TypeAdapter(DrafterConfig)
HttpRequest = CompletionRequest | ChatCompletionRequest | SolveHttpRequest


class Cancelled(Exception):
    """The client went away."""


@dataclass(frozen=True)
class Job:
    """A validated request, ready to run: what the routes hand the engine. `prompts`: one for
    chat and /v1/solve, one or more for completions (each gets n choices)."""

    chat: bool
    prompts: tuple[list[int], ...]
    n: int
    sampling: SamplingConfig
    method: str
    drafter: DrafterConfig
    aggregate: bool
    task: Task
    return_trajectories: bool = False  # /v1/solve: the texts and answers with the vote
    include_usage: bool = False  # a stream's last chunk carries `usage`
    logprobs: int | None = None  # None: not asked; k: the chosen tokens' and k alternatives
    echo: bool = False  # completions: the prompt comes back first (with its logprobs)
    early_stop: bool = False  # /v1/solve: the other rows stop once the vote is decided
    confidence: bool = False  # /v1/solve: each trajectory's confidence
    vote: str = "majority"  # /v1/solve: the vote (`aggregate.confidence.AGGREGATES`)

    @property
    def prompt_ids(self) -> list[int]:
        """The one prompt (chat, /v1/solve, a stream)."""
        return self.prompts[0]

    def usage(self, completion_tokens: int) -> dict:
        """OpenAI's `usage`: each prompt counts once, whatever n."""
        prompt = sum(len(ids) for ids in self.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }


SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
"""Generation config field -> the request field whose default it sets (as vLLM maps them)."""


def sampling_defaults(source: str, generator: Generator) -> dict:
    """vLLM's --generation-config: the sampling defaults a model's `generation_config.json`
    recommends, for requests that leave those fields unset. `auto`: the loaded model's;
    `vllm`: none (the API's own defaults); else a folder holding a generation_config.json.
    Only fields the file sets count (transformers' class defaults are not recommendations)."""
    if source == "vllm":
        return {}
    if source == "auto":
        config = generator.loaded.model.generation_config
    else:
        from transformers import GenerationConfig

        config = GenerationConfig.from_pretrained(source)
    given = config.to_diff_dict() if config is not None else {}
    return {ours: given[k] for k, ours in SAMPLING_DEFAULTS.items() if given.get(k) is not None}


class ServeEngine:
    """With `tensor_parallel` G > 1 this process is rank 0 of G (`actors.tp`): its steps share
    a fixed token budget and GT-sized methods a fixed GPU-like verify cost (a measurement would
    time forwards the other ranks do not mirror)."""

    def __init__(self, cfg: ServeConfig) -> None:
        with startup.held():  # the model's load: no collector passes (the host settles it)
            self.cfg = cfg
            self.tp = None
            if cfg.tensor_parallel > 1:
                from actors.tp import TensorParallelLeader

                self.tp = TensorParallelLeader(cfg.model, cfg.tensor_parallel, cfg.cpus_per_replica)
                self.generator = self.tp.generator
            else:
                self.generator = Generator.load(cfg.model)
            self.served_name = cfg.served_model_name or cfg.model.name
            if cfg.chat_template is not None:  # vLLM's --chat-template, over the tokenizer's
                self.generator.loaded.tokenizer.chat_template = cfg.chat_template
            self.sampling_defaults = sampling_defaults(cfg.generation_config, self.generator)
            # vLLM's --seed: the seeds of requests that give none, in arrival order
            self.seeds = random.Random(cfg.seed) if cfg.seed is not None else None
            self.logprob_format = LogprobFormat(self.generator.loaded.tokenizer)
            self.created = now()
            # concurrent requests share the batch; a short one joins while a long one decodes
            self.host = RunnerHost(
                self.generator,
                cfg.store,
                cfg.store.url,
                cfg.max_rows,
                admission=fair_admission,
                tp_decoder=None if self.tp is None else self.tp.decoder,
                threaded=True,
                warm=True,
            )

    def model_card(self) -> dict:
        """The served model as OpenAI's `/v1/models` lists it."""
        return {
            "id": self.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tts-service",
        }

    # -- the tokenizer (vLLM's /tokenize, /detokenize, /tokenizer_info) --------------------
    def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if req.messages is not None:
            ids = self._chat_ids(req.messages, req.add_generation_prompt)
        else:
            ids = self.generator.loaded.tokenizer(
                req.prompt, add_special_tokens=req.add_special_tokens
            )["input_ids"]
        limit = self.generator.context_limit  # what `prepare` enforces
        return {"count": len(ids), "max_model_len": limit, "tokens": list(ids), "token_strs": None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        vocab = self.generator.loaded.model.config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"tokens: ids are from 0 to {vocab - 1}", "tokens")
        return {"prompt": self.generator.loaded.tokenizer.decode(req.tokens)}

    def tokenizer_info(self) -> dict:
        """What lm-eval's remote tokenizer reads: the special tokens and the chat template."""
        tok = self.generator.loaded.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": self.generator.loaded.model.config.max_position_embeddings,
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
        given = req.model_fields_set
        default = {k: v for k, v in self.sampling_defaults.items() if k not in given}
        suggested = default.get("max_tokens", self.cfg.default_max_tokens)
        max_new = req.max_tokens or min(suggested, self.cfg.max_tokens_cap)  # a default fits
        if max_new > self.cfg.max_tokens_cap:
            raise ApiError(400, f"max_tokens: at most {self.cfg.max_tokens_cap}", "max_tokens")
        return SamplingConfig(
            temperature=default.get("temperature", req.temperature),
            top_p=default.get("top_p", req.top_p),
            top_k=max(default.get("top_k", req.top_k), 0),  # vLLM's -1 is our 0
            min_p=default.get("min_p", req.min_p),
            max_new_tokens=max_new,
            seed=self._seed() if req.seed is None else req.seed,
            run_nonce=self._run_nonce(),
            stop=tuple(req.stop)
            if isinstance(req, CompletionRequest | ChatCompletionRequest)
            else (),
            ignore_eos=isinstance(req, CompletionRequest | ChatCompletionRequest)
            and req.ignore_eos,
        )

    def _seed(self) -> int:
        return self.seeds.randrange(2**31) if self.seeds is not None else secrets.randbelow(2**31)

    def _run_nonce(self) -> int | None:
        """Each request is a run of its own (`streams.row_salt`): a fresh nonce (None: drawn
        with its requests), or with the replica's `--seed` and an in-process store the next of
        its seeded sequence, so that a replica started alike answers the same requests alike,
        as vLLM's `--seed` does (one process's nonces never repeat, and its state is its own).
        Over a Redis store, shared by replicas started alike, always a fresh one."""
        if self.seeds is None or self.cfg.store.url is not None:
            return None
        return self.seeds.getrandbits(63)

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
        if chat:
            prompts = [self._chat_ids(req.messages)]
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            echo = False
        else:
            prompts = [self._prompt_ids(p, i) for i, p in enumerate(req.prompts())]
            logprobs, echo = req.logprobs, req.echo
        self._check_shape(req, len(prompts), logprobs, echo)
        for ids in prompts:
            self._fit(ids, sampling, field)
        method, drafter = self._drafter(req.spec_method)
        return Job(
            chat,
            tuple(prompts),
            req.n,
            sampling,
            method,
            drafter,
            req.aggregate == "majority",
            req.task,
            include_usage=req.stream_options is not None and req.stream_options.include_usage,
            logprobs=logprobs,
            echo=echo,
        )

    def _chat_ids(self, messages: list[ChatMessage], generation_prompt: bool = True) -> list[int]:
        try:
            enc = self.generator.loaded.tokenizer.apply_chat_template(
                [m.template_entry() for m in messages],
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=True,
            )
        except Exception as e:  # the model's own template refused them: the input's fault
            raise ApiError(
                400, f"messages: the chat template rejected them: {e}", "messages"
            ) from e
        ids = list(enc["input_ids"])
        if not ids:
            raise ApiError(400, "messages: encodes to no tokens", "messages")
        return ids

    def _prompt_ids(self, prompt: Prompt, i: int) -> list[int]:
        """A completions prompt as token ids: a string encoded, ids checked against the vocab."""
        if isinstance(prompt, str):
            ids = list(self.generator.loaded.tokenizer(prompt)["input_ids"])
            if not ids:
                raise ApiError(400, f"prompt: prompt {i} encodes to no tokens", "prompt")
            return ids
        vocab = self.generator.loaded.model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt: prompt {i} has token id {bad} (ids are 0 to {vocab - 1})", "prompt"
            )
        return list(prompt)

    def _check_shape(
        self, req: HttpRequest, prompts: int, logprobs: int | None, echo: bool
    ) -> None:
        """What this server does not combine: a 400 naming the field."""
        if prompts * req.n > self.cfg.max_n:
            raise ApiError(
                400, f"prompt: {prompts} prompts x n {req.n} > max_n {self.cfg.max_n}", "prompt"
            )
        if req.stream and prompts > 1:
            raise ApiError(400, "prompt: a stream takes one prompt", "prompt")
        if req.aggregate and prompts > 1:
            raise ApiError(400, "aggregate: the vote takes one prompt", "aggregate")
        if req.stream and logprobs is not None:
            raise ApiError(400, "logprobs: not with stream (ask without streaming)", "logprobs")
        if req.stream and echo:
            raise ApiError(400, "echo: not with stream", "echo")
        if logprobs is not None and self.tp is not None:
            raise ApiError(400, "logprobs: not on a tensor-parallel replica", "logprobs")

    def prepare_solve(self, req: SolveHttpRequest) -> Job:
        self.check_model(req.model)
        sampling = self._sampling(req)
        try:
            ids = self.generator.encode(req.question, chat=True)
        except ValueError as e:  # no chat template (the model's, nor --chat-template)
            raise ApiError(400, f"question: {e}", "question") from e
        self._fit(ids, sampling, "question")
        method, drafter = self._drafter(req.method)
        return Job(
            True,
            (ids,),
            req.n,
            sampling,
            method,
            drafter,
            True,
            req.task,
            req.return_trajectories,
            early_stop=req.early_stop,
            confidence=req.confidence,
            vote=req.aggregate,
        )

    # -- execution -----------------------------------------------------------------------
    def _store(self, ids: list[int]) -> NgramStore:
        try:
            return self.host.problem_store(problem_id(ids))
        except StoreUnavailableError as e:
            raise ApiError(503, str(e), None, "service_unavailable") from e

    def close(self) -> None:
        """The replica's end: the global store pushes what it queued (a bounded wait); a
        tensor-parallel replica's other ranks stop."""
        self.host.close()
        if self.tp is not None:
            self.tp.close()

    def _run(
        self,
        job: Job,
        cancel: threading.Event,
        on_commit: Callable[[int, Sequence[int]], bool] | None = None,
        on_result: Callable[[TrajectoryResult], None] | None = None,
        stop: EarlyStop | None = None,
    ) -> RunReport:
        """The request's trajectories, n per prompt, all in the replica's one batch, their
        results in choice order (prompt, then index); each stops at its next step once `cancel`
        is set (the client went away), or with `stop` once its prompt's vote is decided.
        `on_commit(choice, tokens)` sees every step."""
        keep_going = on_commit or (lambda _i, _t: not cancel.is_set())
        skip: Callable[[TrajectoryRequest], bool] = lambda _r: cancel.is_set()  # noqa: E731
        if stop is not None:
            on_result, skip = stop.noting(on_result), stop.skipping(skip)
        with contextlib.ExitStack() as stores:  # the request's end is its stores'
            problems = [
                (str(p), ids, stores.enter_context(contextlib.closing(self._store(ids))))
                for p, ids in enumerate(job.prompts)
            ]
            return self.host.problems(
                problems,
                range(job.n),
                job.sampling,
                job.drafter,
                on_commit=lambda p, i, tokens: keep_going(p * job.n + i, tokens),
                on_result=on_result,
                skip=skip,
                confidence=job.confidence,
            )

    def _trajectories(
        self, job: Job, cancel: threading.Event, stop: EarlyStop | None = None
    ) -> RunReport:
        """Every trajectory of the request (with `stop`, those decoded before the vote was
        decided), or `Cancelled`."""
        report = self._run(job, cancel, stop=stop)
        if cancel.is_set():
            raise Cancelled
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
            ext["aggregate"] = {"method": "majority", **vote.to_dict()}
        return ext

    def complete(self, job: Job, cancel: threading.Event) -> dict:
        try:
            report = self._trajectories(job, cancel)
        except Cancelled:
            return {}
        outs = [r.output for r in report.results]
        finish = {"cancelled": "stop"}
        choices = []
        for i, o in enumerate(outs):
            prompt = job.prompts[i // job.n]
            if job.chat:
                choice: dict = {"index": i, "message": {"role": "assistant", "content": o.text}}
                if job.logprobs is not None:
                    scored = self._score(prompt, o.token_ids, len(prompt), job.logprobs)
                    choice["logprobs"] = self.logprob_format.chat(scored, job.logprobs)
                else:
                    choice["logprobs"] = None
            else:
                # the prompt as its tokens read (special ones too), so `text_offset` fits it
                echoed = self.generator.loaded.tokenizer.decode(prompt) if job.echo else ""
                choice = {"index": i, "text": echoed + o.text, "logprobs": None}
                if job.logprobs is not None:
                    start = 0 if job.echo else len(prompt)
                    scored = self._score(prompt, o.token_ids, start, job.logprobs)
                    choice["logprobs"] = self.logprob_format.completion(scored, job.logprobs)
            choice["finish_reason"] = finish.get(o.finish_reason, o.finish_reason)
            choices.append(choice)
        return {
            "id": new_id("chatcmpl" if job.chat else "cmpl"),
            "object": "chat.completion" if job.chat else "text_completion",
            "created": now(),
            "model": self.served_name,
            "choices": choices,
            "usage": job.usage(sum(len(o.token_ids) for o in outs)),
            "tts": self._extension(job, report),
        }

    def _score(
        self, prompt: list[int], completion: Sequence[int], start: int, top: int
    ) -> ScoredTokens:
        """The target's logprobs of (prompt + completion)[start:], with `top` alternatives."""
        ids = [*prompt, *completion]
        return ScoredTokens(ids[start:], self.host.score(ids, start, top))

    def stream(
        self, job: Job, cancel: threading.Event, emit: Callable[[dict | None], None]
    ) -> dict:
        """The n choices decode together; each streams as text deltas tagged with its index
        (interleaved, as OpenAI streams n > 1) and ends with its finish chunk; with
        `include_usage`, a last chunk with no choices carries `usage`; `emit(None)` ends the
        stream. Returns the usage (a cancelled stream's: the tokens it decoded)."""
        out = ChoiceStream(job, self.served_name, self.generator.decode, emit)
        try:
            for i in range(job.n):
                out.chunk(i, None, None, first=True)

            def on_commit(i: int, tokens: Sequence[int]) -> bool:
                out.commit(i, tokens)
                return not cancel.is_set()

            self._run(job, cancel, on_commit, out.finish)
            return out.end()
        finally:
            emit(None)

    def solve(self, job: Job, cancel: threading.Event) -> dict:
        stop = EarlyStop(job.n, job.task) if job.early_stop else None
        try:
            report = self._trajectories(job, cancel, stop)
        except Cancelled:
            return {}
        done = [(r.request.index, r.output) for r in report.results]
        answers = [extract_answer(o.text, job.task) for _, o in done]
        sure = {r.request.index: r.confidence for r in report.results if r.confidence}
        order = [i for i, _ in done]
        vote = labelled_vote(job.vote, answers, [sure.get(i) for i in order], order, job.task)
        stats = report.summary()
        body = {
            "answer": vote["answer"],
            "votes": vote["votes"],
            "share": vote["share"],
            "no_answer": vote["no_answer"],
            "task": job.task,
            "n": job.n,
            "decoded": len(done),
            "stopped_early": len(done) < job.n,
            "method": job.method,
            "stats": {
                **stats,
                "trajectories": [
                    {"index": i, "stats": o.stats.to_dict()} | _confidence(sure, i) for i, o in done
                ],
            },
            "usage": job.usage(sum(len(o.token_ids) for _, o in done)),
        }
        body |= {k: vote[k] for k in ("aggregate", "majority") if k in vote}  # a weighted one
        if job.return_trajectories:
            body["trajectories"] = [
                {"index": i, "text": o.text, "finish_reason": o.finish_reason, "answer": a}
                | _confidence(sure, i)
                for (i, o), a in zip(done, answers, strict=True)
            ]
        return body


def _confidence(sure: dict[int, dict], index: int) -> dict:
    return {"confidence": sure[index]} if index in sure else {}


class ChoiceStream:
    """One streamed response's chunks: each choice's text as it decodes, never a stop string
    or a partial character (held back until the text after it is known), then its finish."""

    def __init__(
        self,
        job: Job,
        model: str,
        decode: Callable[[list[int]], str],
        emit: Callable[[dict | None], None],
    ) -> None:
        self.job, self.model, self.emit = job, model, emit
        self.id, self.created = new_id("chatcmpl" if job.chat else "cmpl"), now()
        self.texts = [StableText(decode, job.sampling.stop) for _ in range(job.n)]
        self.final: dict[int, int] = {}  # index -> its output's tokens, once it has ended

    def send(self, choices: list[dict], **usage) -> None:
        self.emit(
            {
                "id": self.id,
                "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **usage,
            }
        )

    def chunk(self, index: int, text: str | None, finish: str | None, first: bool = False):
        if self.job.chat:
            delta = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish}
        self.send([choice], **({"usage": None} if self.job.include_usage else {}))

    def commit(self, i: int, tokens: Sequence[int]) -> None:
        """Choice i's step: send the text that can no longer change."""
        if delta := self.texts[i].commit(tokens):
            self.chunk(i, delta, None)

    def finish(self, res: TrajectoryResult) -> None:
        """Choice i ended: the rest of its text, then its finish chunk."""
        i, out = res.request.index, res.output
        self.final[i] = len(out.token_ids)
        if rest := self.texts[i].finish(out.text):
            self.chunk(i, rest, None)
        self.chunk(i, None, "stop" if out.finish_reason == "cancelled" else out.finish_reason)

    def end(self) -> dict:
        """The usage (a cancelled stream's: the tokens it decoded), sent last when asked."""
        n = self.job.n
        usage = self.job.usage(sum(self.final.get(i, len(self.texts[i].ids)) for i in range(n)))
        if self.job.include_usage:
            self.send([], usage=usage)
        return usage
