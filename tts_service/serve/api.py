"""Request and response shapes of the HTTP API (OpenAI's, plus our extension fields).

Requests are validated here, at the boundary; an invalid one becomes an OpenAI-style error
body that names the field (`{"error": {"message", "type", "param", "code"}}`), never a 500.
Validation is strict (`n: "4"`, `max_tokens: true` and `stream: "yes"` are errors, not
coerced); a field beyond OpenAI's API and ours is dropped with a warning, as vLLM does, or is an
error in strict mode (`reject_unknown_fields`). OpenAI parameters this server does not implement
(`presence_penalty`, `tools`, ...) are accepted only at their no-op value, so the OpenAI
client works unchanged and nothing a user asks for is silently ignored. `top_k` and `min_p`
are vLLM's extensions, with its conventions. Log-probabilities (`logprobs`, `top_logprobs`,
`echo`) are the target's raw distribution (`engine.scoring`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tts_service.aggregate.confidence import Aggregate, vote_fields
from tts_service.config.base import first_error
from tts_service.config.decoding import MAX_CONTEXT
from tts_service.drafters.registry import MethodName

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="End the stream with a usage chunk.")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    user: str | None = Field(None, description="The caller's label (OpenAI metadata).")
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1: all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop p < min_p x the top p.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    spec_method: MethodName | None = Field(None, description="Speculative method (extension).")
    aggregate: Literal["majority"] | None = Field(None, description="Vote over the n choices.")
    task: Literal["math", "choice", "code"] = Field("math", description="How to vote.")
    ignore_eos: bool = Field(False, description="Decode past EOS to max_tokens (vLLM's).")
    metadata: dict[str, str] | None = Field(None, description="The caller's tags (OpenAI).")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (JSON's escapes can carry a lone surrogate, which the
    tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unicode(text: str) -> str:
    if not _is_unicode(text):
        raise ValueError("not valid Unicode (a lone surrogate)")
    return text


Text = Annotated[str, AfterValidator(_unicode)]
"""A string the tokenizer can take: a lone surrogate is a 400 naming the field."""


class TextPart(BaseModel):
    """One part of a message's content; only text (images and audio are 400s naming `type`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: object) -> object:
        """Name the part this server cannot read (an image, audio) rather than the union."""
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"part {i}: type {kind!r} is not supported (text only)")
        return v

    name: str | None = Field(
        None, description="The author's name (OpenAI; not shown to the model)."
    )

    def template_entry(self) -> dict:
        """The message as chat templates take it: `developer` is the newer API's `system`,
        content parts joined."""
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_Request):
    """`logprobs`: the chosen tokens' log-probabilities; `top_logprobs` k: the k most likely
    tokens at each too (OpenAI's rule: only with `logprobs`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False  # null: false, as OpenAI's spec allows
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_CONTEXT, description="The current OpenAI name of max_tokens."
    )

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees(cls, v: int | None, info: ValidationInfo) -> int | None:
        given = info.data.get("max_tokens")
        if v is not None and given is not None and given != v:
            raise ValueError(f"differs from max_tokens ({given}): give one")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("only with logprobs true")
        return v

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        """`max_completion_tokens` (what the current OpenAI SDK sends) is `max_tokens`."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


Prompt = str | list[int]


def _is_id(x: object) -> bool:
    return type(x) is int and 0 <= x < 2**31


class CompletionRequest(_Request):
    """`prompt`: a string, a list of strings, a list of token ids or a list of such lists;
    every prompt gets `n` choices (choice index = prompt's position × n + its own index).
    `logprobs` k: the chosen tokens' log-probabilities and the k most likely at each; `echo`:
    the prompt comes back before the completion (with its logprobs when asked)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False  # null: false

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: object) -> object:
        """One message naming what is wrong (the union's own would name its four members).
        Every id is checked, whatever its place: a bad one must never reach a shared forward."""
        if isinstance(v, str) or (isinstance(v, list) and v and type(v[0]) is int):
            prompts = [v]
        elif isinstance(v, list) and v:
            prompts = v
        else:
            raise ValueError("a string, a list of strings, of token ids, or of token id lists")
        for i, p in enumerate(prompts):
            if not isinstance(p, str | list):
                raise ValueError(f"prompt {i}: a string or a list of token ids")
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if isinstance(p, list) and not all(_is_id(t) for t in p):
                raise ValueError(f"prompt {i}: token ids are integers from 0 to 2**31 - 1")
            if isinstance(p, str) and not _is_unicode(p):
                raise ValueError(f"prompt {i}: not valid Unicode (a lone surrogate)")
            if type(p) is not type(prompts[0]):
                raise ValueError("prompts of one kind: all strings or all token id lists")
        return v

    def prompts(self) -> list[Prompt]:
        """Every prompt, each a string or a list of token ids."""
        v = self.prompt
        return [v] if isinstance(v, str) or isinstance(v[0], int) else list(v)


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class SolveHttpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    question: Text = Field(min_length=1)
    task: Literal["math", "choice", "code"] = "math"
    n: int = Field(16, ge=1, le=64)
    temperature: float = Field(0.6, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    method: MethodName | None = None
    return_trajectories: bool = False
    early_stop: bool = True  # stop the other trajectories once the vote is decided
    confidence: bool = True  # each trajectory's confidence (DeepConf's), in stats.trajectories
    aggregate: Aggregate = "majority"  # or confidence / filtered: they change answers
    model: str | None = None

    _vote_fields = model_validator(mode="before")(vote_fields)


class ApiError(Exception):
    """An error with its HTTP status, the field it is about and the headers it carries
    (a 429's `Retry-After`)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


# OpenAI parameters without an implementation here, and the values that ask for nothing
NO_OP_VALUES: dict[str, tuple] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
    "store": (None, False),
    "parallel_tool_calls": (None, True, False),  # no tools: nothing to run in parallel
    "reasoning_effort": (None,),  # a reasoning budget would change what is generated
    "verbosity": (None,),
    "service_tier": (None, "auto", "default"),  # one tier here
}


def _kind(x: object) -> str:
    if isinstance(x, bool):
        return "bool"
    return "number" if isinstance(x, int | float) else type(x).__name__


def _no_op(value: object, allowed: tuple) -> bool:
    # by kind, so `false` is not taken for 0 nor `0` for False, while 0 and 0.0 are the same
    return any(_kind(value) == _kind(a) and value == a for a in allowed)


def _bounded_int(text: str) -> int | float:
    """A JSON integer; one of more than 32 digits is ±inf, so that the field's validation names
    it (out of range, or not finite) instead of Python's 4,300-digit limit giving a 500."""
    if len(text.lstrip("-")) <= 32:
        return int(text)
    return float("-inf") if text.startswith("-") else float("inf")


def parse(model_cls: type[BaseModel], raw: bytes, strict: bool = True) -> BaseModel:
    """Bytes -> a validated request. Raises ApiError (400) naming the first bad field.

    `strict=False` (vLLM's behaviour, the default of the OpenAI routes): a top-level field that
    neither OpenAI's API nor ours defines is dropped with a warning in the log, not refused.
    """
    try:
        data = json.loads(raw, parse_int=_bounded_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", "body") from e
    except RecursionError as e:  # '[' * 2000: deeper than the parser goes
        raise ApiError(400, "request body is nested too deeply", "body") from e
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", "body")
    if issubclass(model_cls, _Request):
        unknown = [k for k in data if k not in model_cls.model_fields and k not in NO_OP_VALUES]
        if unknown and not strict:
            for key in unknown:
                del data[key]
            log.warning("request fields ignored (not in the API): %s", ", ".join(unknown))
        for key, allowed in NO_OP_VALUES.items():
            if key in data and not _no_op(data.pop(key), allowed):
                shown = ", ".join(json.dumps(a) for a in allowed)
                raise ApiError(400, f"{key}: not supported by this server (only {shown})", key)
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        loc, msg = first_error(e)
        # the field's path, without pydantic's names of union members and validators
        param = ".".join(x for x in loc if "[" not in x) or "body"
        raise ApiError(400, f"{param}: {msg}", param) from e
    if isinstance(req, _Request) and req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
