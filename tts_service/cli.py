"""The `tts` command (also `python -m tts_service`).

Each subcommand parses flags over a YAML preset, validates everything with pydantic before
loading anything, and exits with code 2 and one line on stderr naming the bad field.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from tts_service.config import METHODS, GenerateRequest, load_yaml

DEFAULT_PRESET = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _field_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"] if not str(x).isdigit()]
    name = loc[-1] if loc else "input"
    if loc and loc[0] == "drafter" and len(loc) > 1:
        name = loc[-1]
    return f"--{name.replace('_', '-')}: {first['msg']}"


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--config", default=str(DEFAULT_PRESET), help="YAML preset (configs/)")
    p.add_argument("--model", help="alias (smollm2-135m), hub id or local path")
    p.add_argument("--method", help=f"one of {', '.join(METHODS)}")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16, float64")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--num-nodes", type=int, help="draft tree size (recycle)")
    p.add_argument("--tree", help="tree shape name or JSON path (recycle)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_request(args: argparse.Namespace) -> GenerateRequest:
    """Merge preset and flags into a validated request (raises UsageError)."""
    try:
        preset = load_yaml(args.config)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config: {e}") from e
    method = args.method or preset.get("method", "pld")
    if method not in METHODS:
        raise UsageError(f"--method: unknown method {method!r} (choose {', '.join(METHODS)})")
    kind = METHODS[method]
    drafter = {"kind": kind, **preset.get("drafters", {}).get(kind, {})}
    drafter.update(
        {
            k: v
            for k, v in (("num_nodes", args.num_nodes), ("tree", args.tree))
            if v is not None and kind == "recycling"
        }
    )
    model = dict(preset.get("model", {}))
    model.update({k: getattr(args, k) for k in ("device", "dtype") if getattr(args, k)})
    if args.model is not None:
        model["name"] = args.model
    sampling = dict(preset.get("sampling", {}))
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = tuple(args.stop) if key == "stop" else getattr(args, key)
    raw: dict[str, Any] = {
        "prompt": args.prompt,
        "model": model,
        "drafter": drafter,
        "sampling": sampling,
        "chat": args.chat,
    }
    try:
        return GenerateRequest.model_validate(raw)
    except ValidationError as e:
        raise UsageError(_field_error(e)) from e


def cmd_generate(args: argparse.Namespace) -> int:
    req = build_request(args)
    from tts_service.generation import Generator, InputTooLongError  # heavy: after validation
    from tts_service.models import ModelNotFoundError

    try:
        gen = Generator.load(req.model)
        result = gen.generate(req.prompt, req.drafter, req.sampling, chat=req.chat)
    except ModelNotFoundError as e:
        raise UsageError(f"--model: {e}") from e
    except InputTooLongError as e:
        raise UsageError(f"prompt: {e}") from e
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        print(result.text)
        print(json.dumps(result.stats.to_dict()), file=sys.stderr)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tts", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="one generation with a speculative method")
    _add_generation_flags(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"tts: error: {e}", file=sys.stderr)
        return 2
