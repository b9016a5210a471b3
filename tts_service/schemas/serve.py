"""The HTTP service's config: one model per replica, OpenAI-compatible routes plus /v1/solve."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from store.config import StoreConfig
from tts_service.config import MaxRows, ModelConfig, StrictConfig
from tts_service.drafters.registry import DEFAULT_METHOD, METHOD_NAMES


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


class ServeConfig(StrictConfig):
    """The HTTP service: one model per replica, OpenAI-compatible routes plus /v1/solve."""

    model: ModelConfig = ModelConfig()
    served_model_name: str | None = Field(None, description="Name in /v1/models (default: model).")
    default_method: str = Field(DEFAULT_METHOD, description="A method name (drafters/registry.py).")
    drafters: dict[str, dict] = Field(
        default_factory=dict, description="Per-method drafter fields, as in configs/default.yaml."
    )
    store: StoreConfig = StoreConfig()
    api_key: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Every route requires `Authorization: Bearer KEY` (vLLM's --api-key); "
        "none: no auth.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve beyond loopback with no API key: anyone who reaches the port may "
        "use it (refused otherwise).",
    )
    host: str = Field("127.0.0.1", description="Bind address of the HTTP server.")
    port: int = Field(8000, ge=1, le=65535, description="Port of the HTTP server.")
    route_prefix: str = "/"
    num_replicas: int = Field(1, ge=1)
    autoscaling: dict | None = Field(None, description="Serve autoscaling_config (min/max...).")
    cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs per replica (per rank).")
    tensor_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ranks of each replica: the replica is rank 0, the others Ray actors in "
        "its STRICT_PACK group (gloo on CPU, NCCL on GPUs).",
    )
    placement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long `tts serve` waits for a tensor-parallel replica's ranks to be "
        "placed on one node, then exits naming what the cluster has.",
    )
    max_n: int = Field(64, ge=1, le=64)
    max_tokens_cap: int = Field(1024, ge=1, description="Largest max_tokens a request may ask.")
    default_max_tokens: int = Field(256, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies get 413.")
    body_timeout_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="Seconds a request's body may take to arrive once its headers have: then "
        "408, and the request holds no slot.",
    )
    max_rows: MaxRows | None = Field(None, description="Rows a replica decodes together.")
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request still running after this gets 504 (its work stops)."
    )
    max_queued_requests: int = Field(
        64, ge=1, le=4096, description="Requests a replica holds, running or waiting; then 429."
    )
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="Sampling defaults for requests that leave them unset (temperature, "
        "top_p, top_k, min_p, max_tokens): auto, the model's generation_config.json; vllm, "
        "none; or a folder holding one (vLLM's --generation-config).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning",
        description="Ray's and Serve's own log lines at this level and above (info: their "
        "access and per-call lines too); one access line per request at every level but "
        "error, as vLLM prints them.",
    )
    reject_unknown_fields: bool = Field(
        False,
        description="A chat or completions field beyond OpenAI's API and ours is a 400; "
        "default: dropped with a warning in the log, as vLLM does.",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="Seeds the requests that give none, in arrival order (vLLM's --seed); "
        "none: each gets a random seed.",
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="A Jinja chat template, or a file holding one, over the tokenizer's "
        "(vLLM's --chat-template).",
    )

    @field_validator("host")
    @classmethod
    def _no_open_door(cls, v: str, info: ValidationInfo) -> str:
        """Beyond loopback, an API key or an explicit `allow_unauthenticated`."""
        if is_loopback(v) or info.data.get("api_key") or info.data.get("allow_unauthenticated"):
            return v
        raise ValueError(
            f"{v} is beyond loopback and no API key is set: anyone who reaches it could use "
            "the server; give --api-key (or $TTS_API_KEY), or --allow-unauthenticated"
        )

    @field_validator("default_method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        if v not in METHOD_NAMES:
            raise ValueError(f"unknown method {v!r} (choose {', '.join(METHOD_NAMES)})")
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, v: str | None) -> str | None:
        """A file's template is read here, so replicas on other nodes get its text."""
        if v is None or "{" in v:
            return v
        try:
            return Path(v).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"neither a Jinja template nor a readable file: {e}") from e

    @field_validator("store")
    @classmethod
    def _no_private_redis(cls, v: StoreConfig) -> StoreConfig:
        if v.url == "local-redis":
            raise ValueError("local-redis is for one command; give the service a redis:// URL")
        return v
