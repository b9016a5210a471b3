"""The target model and how its next token is chosen: what plain decoding samples from."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tts_service.config.base import StrictConfig

MAX_CONTEXT = 1 << 21
"""Above any model's context: a larger `max_new_tokens` is refused before a model loads."""


class SamplingConfig(StrictConfig):
    """How the target model's next token is chosen: exactly what plain decoding samples from."""

    temperature: float = Field(0.6, ge=0.0, description="0 means greedy (argmax).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus filter, (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top token's p; 0 disables."
    )
    max_new_tokens: int = Field(
        256,
        ge=1,
        le=MAX_CONTEXT,
        description="Generation stops after this many tokens (at most the model's context, "
        "checked when the prompt is known).",
    )
    seed: int = Field(0, ge=0, description="Seeds the trajectory's sampling and drafting streams.")
    run_nonce: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="Salts the random streams of rows that draft and sample, so that no two "
        "rows whose drafters share state share uniforms: drawn per run and recorded in its "
        "output when unset; give a recorded one to reproduce that run over a fresh store.",
    )
    stop: tuple[str, ...] = Field(
        (), description="Stop strings: the output ends before the first of them to appear."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks only).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class ModelConfig(StrictConfig):
    """Which target model to load and where it runs."""

    name: str = Field("smollm2-135m", min_length=1, description="Alias, hub id or local path.")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto",
        description="auto (bfloat16 on CUDA, float32 on CPU), float32, float64, bfloat16, float16.",
    )
    device: str = Field(
        "auto", description="auto (cuda if present, else cpu), cpu, cuda or cuda:N."
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    forward: Literal["transformers", "compact"] = Field(
        "transformers",
        description="The target's forward: transformers' modelling code, or compact (Llama "
        "and Qwen2 families: fused QKV and gate-up products over the same weights, "
        "engine/compact.py; one process, not tensor-parallel ranks).",
    )
    compile: bool = Field(
        False,
        description="With forward: compact, compile the layers' element-wise work with "
        "torch.compile (inductor; on a GPU inside the CUDA graphs). Paid once per process "
        "before the first request (announced; inductor keeps it on disk for the next).",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest prompt plus new tokens a request may have; none: the model's "
        "context (vLLM's --max-model-len).",
    )
    prefill_chunk: int | None = Field(
        None,
        ge=16,
        description="Most prompt tokens one prefill forward runs: a longer prompt is prefilled "
        "a chunk at a time between the batch's steps (vLLM's max_num_batched_tokens); none: "
        "512 on a CPU, 2048 on a GPU.",
    )
    kv_cache_memory: float | None = Field(
        None,
        gt=0,
        description="GiB the batch's KV cache may hold: a request whose prompt plus max_tokens "
        "needs more alone is refused, one that does beside the running rows waits for rows to "
        "leave; none: 90% of the GPU's free memory once the model is loaded, half the memory "
        "available on a CPU.",
    )
    max_memory: dict[str, str] | None = Field(
        None,
        description="Shard over the visible GPUs (device_map='auto') within these per-device "
        "budgets, e.g. {'0': '70GiB', '1': '70GiB', 'cpu': '0GiB'}; set by the placement plan.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On a CUDA device, capture the verify forward as CUDA graphs per (rows, "
        "tokens) bucket (engine/graphs.py); a capture that fails falls back to eager.",
    )
    graph_acceptance: bool | None = Field(
        None,
        description="With cuda_graphs, capture each step's acceptance too (p, top-k, rules "
        "(a) and (b), the bonus: one replay instead of ~70 launches; engine/graphs.py "
        "GraphedAcceptance), per bucket and sampling parameters; batches it cannot serve run "
        "it eagerly. null (default): on wherever the forward is captured (a CUDA device with "
        "cuda_graphs); false: the eager acceptance; true on a CPU runs the captured path "
        "eagerly, as the tests check it.",
    )
    cost_model: Literal["learned", "measured"] = Field(
        "learned",
        description="How speculation prices tree tokens on this device. learned: a roofline "
        "prior from four timed forwards (or the surface kept in cost_cache), refined from every "
        "step; measured: time every batched shape before the first step (seconds to minutes on "
        "a CPU, the earlier behaviour).",
    )
    cost_cache: str | None = Field(
        default_factory=lambda: os.environ.get("TTS_COST_CACHE", "~/.cache/tts-service/cost"),
        description="Directory where learned cost surfaces are kept per (model, device), so the "
        "next process starts from them; null: keep nothing ($TTS_COST_CACHE sets the default).",
    )

    @property
    def cost_cache_dir(self) -> Path | None:
        """`cost_cache` as a path (`~` expanded), or None: keep nothing."""
        return Path(self.cost_cache).expanduser() if self.cost_cache else None

    tune_matmul: bool = Field(
        True,
        description="On a CPU, time both matrix products of every linear layer shape at load "
        "and use the faster per row count (engine/matmul.py).",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {v!r}")
        return v

    @model_validator(mode="after")
    def _compile_needs_compact(self) -> ModelConfig:
        if self.compile and self.forward != "compact":
            raise ValueError("compile: needs forward: compact (it compiles that forward)")
        return self


MaxRows = Annotated[int, Field(ge=1, le=256)]


def default_max_rows(device: str) -> int:
    """Rows decoded together when the user does not say: 16 on a CPU (a 16-row step costs
    ~2.3x a 1-row step here, so the batch pays; more rows stop paying), 64 on a GPU."""
    return 64 if device.startswith("cuda") else 16
