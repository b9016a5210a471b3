"""What every `tts` subcommand shares: the usage-error path (exit 2, one line naming the field),
the flags over a YAML preset, and the validated request built from them before anything heavy
is imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError

from tts_service.config import (
    DRAFTER_CONFIGS,
    CalibrateTreeRequest,
    GenerateRequest,
    SolveRequest,
    load_yaml,
)
from tts_service.drafters.methods import DEFAULT_METHOD, METHOD_NAMES, method_drafter

DEFAULT_PRESET = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def field_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"] if not str(x).isdigit()]
    name = loc[-1] if loc else "input"
    return f"--{name.replace('_', '-')}: {first['msg'].removeprefix('Value error, ')}"


def add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_PRESET), help="YAML preset (configs/)")
    p.add_argument("--model", help="alias (smollm2-135m), hub id or local path")
    p.add_argument("--method", help=f"one of {', '.join(METHOD_NAMES)}")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16, float64")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--num-nodes", type=int, help="draft tree size (recycle, stand, goose)")
    p.add_argument("--tree", help="tree shape name or JSON path (recycle, stand)")
    p.add_argument("--deterministic", action="store_true", help="stand: top-k, not Gumbel")
    p.add_argument(
        "--harvest-rejected",
        action="store_true",
        help="stand: also store distributions at rejected tree nodes",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def request(args: argparse.Namespace, model_cls: type[BaseModel], extra: dict) -> Any:
    """Merge the preset and the flags into a validated request (raises UsageError)."""
    try:
        preset = load_yaml(args.config)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config: {e}") from e
    method = args.method or preset.get("method", DEFAULT_METHOD)
    device = args.device or preset.get("model", {}).get("device", "auto")
    try:
        drafter = method_drafter(method, preset.get("drafters", {}), device)
    except ValueError as e:
        raise UsageError(f"--method: {e}") from e
    fields = DRAFTER_CONFIGS[drafter["kind"]].model_fields  # a flag applies where it is a field
    flags = {
        "num_nodes": args.num_nodes,
        "tree": args.tree,
        "stochastic": False if args.deterministic else None,
        "harvest_rejected": True if args.harvest_rejected else None,
    }
    drafter.update({k: v for k, v in flags.items() if v is not None and k in fields})
    model = dict(preset.get("model", {}))
    model.update({k: getattr(args, k) for k in ("device", "dtype") if getattr(args, k)})
    if args.model is not None:
        model["name"] = args.model
    sampling = dict(preset.get("sampling", {}))
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = tuple(args.stop) if key == "stop" else getattr(args, key)
    raw = {"model": model, "drafter": drafter, "sampling": sampling, **extra}
    try:
        return model_cls.model_validate(raw)
    except ValidationError as e:
        raise UsageError(field_error(e)) from e


def load(req: GenerateRequest | SolveRequest | CalibrateTreeRequest):
    from tts_service.drafters.registry import needs_cost  # heavy: only after validation
    from tts_service.generation import Generator
    from tts_service.models import ModelNotFoundError, resolve_device

    try:
        resolve_device(req.model.device)  # cuda asked on a machine without it
    except ValueError as e:
        raise UsageError(f"--device: {e}") from e
    try:
        calibrate = isinstance(req, GenerateRequest | SolveRequest) and needs_cost(req.drafter)
        return Generator.load(req.model, calibrate=calibrate)
    except ModelNotFoundError as e:
        raise UsageError(f"--model: {e}") from e
