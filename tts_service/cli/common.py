"""What every `tts` subcommand shares: the usage-error path (exit 2, one line naming the field),
the flags over a YAML preset, and the validated request built from them before anything heavy
is imported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from tts_service.cli.usage import UsageError
from tts_service.config import first_error, load_yaml
from tts_service.drafters.registry import (
    DEFAULT_METHOD,
    DRAFTER_CONFIGS,
    METHOD_NAMES,
    method_drafter,
    size_field,
)
from tts_service.schemas import CalibrateTreeRequest, GenerateRequest, ServeConfig, SolveRequest
from tts_service.timing import phase

DEFAULT_PRESET = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


FLAG_OF_FIELD = {"url": "store"}
"""Fields whose flag has another name (`--store` sets the store's `url`)."""


def field_error(err: ValidationError) -> str:
    """The first error as `--flag: message`; a check over several fields names its field as
    its message's first word (`early_stop: ...`)."""
    path, msg = first_error(err)
    loc = [x for x in path if not x.isdigit()]
    name = FLAG_OF_FIELD.get(loc[-1], loc[-1]) if loc else "input"
    return f"--{name.replace('_', '-')}: {msg}"


def schema_field(model: type[BaseModel], path: str) -> tuple[FieldInfo, Any]:
    """The field at a dotted `path` of `model` and its default, read through the defaults of
    the fields above it (`CalibrateTreeRequest.sampling` defaults to max_new_tokens=128)."""
    *parents, leaf = path.split(".")
    cls, above = model, None  # above: the default instance of the field above the leaf
    for part in parents:
        above = cls.model_fields[part].get_default(call_default_factory=True)
        cls = type(above)
    field = cls.model_fields[leaf]
    if above is None:
        return field, field.get_default(call_default_factory=True)
    return field, getattr(above, leaf)


def with_default(text: str | None, default: Any) -> str:
    """Help text ending in the default, when there is one to show."""
    text = (text or "").rstrip(".")
    if default is None or default == () or isinstance(default, bool):
        return text
    return f"{text} (default: {', '.join(default) if isinstance(default, tuple) else default})"


def add_field(
    p: argparse.ArgumentParser,
    model: type[BaseModel],
    path: str,
    preset: dict | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    **kw: Any,
) -> None:
    """`--name` (and `aliases`) for the schema field at `path`: its help is the field's
    description and default (the preset's value, if it has one), so neither can drift from the
    schema. The flag itself defaults to None: what is not given is left to the preset and the
    schema."""
    field, default = schema_field(model, path)
    leaf = path.rsplit(".", 1)[-1]
    if preset is not None:
        default = preset.get(leaf, default)
    if "type" not in kw and "action" not in kw and field.annotation in (int, float, str):
        kw["type"] = field.annotation
    flag = flag or f"--{leaf.replace('_', '-')}"
    p.add_argument(flag, *aliases, help=with_default(field.description, default), **kw)


def add_common_flags(p: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """The flags of `tts generate` and `tts solve` over `model`'s fields; the defaults shown are
    configs/default.yaml's."""
    preset = load_yaml(DEFAULT_PRESET)
    p.add_argument(
        "--config",
        default=str(DEFAULT_PRESET),
        help="YAML preset; the defaults shown are configs/default.yaml's",
    )
    add_field(p, model, "model.name", preset.get("model", {}), flag="--model")
    method = preset.get("method", DEFAULT_METHOD)
    p.add_argument("--method", help=with_default(f"one of {', '.join(METHOD_NAMES)}", method))
    add_field(p, model, "model.device", preset.get("model", {}))
    add_field(p, model, "model.dtype", preset.get("model", {}))
    for name in ("temperature", "top_p", "top_k", "max_new_tokens", "seed"):
        add_field(p, model, f"sampling.{name}", preset.get("sampling", {}))
    add_field(p, model, "sampling.stop", preset.get("sampling", {}), action="append")  # repeatable
    add_field(p, model, "sampling.run_nonce", preset.get("sampling", {}), type=int)
    p.add_argument(
        "--num-nodes",
        type=int,
        help="draft size: the method's size field (tree nodes; PLD: chain length; GTCP: cap)",
    )
    p.add_argument("--tree", help="tree shape name or JSON path (recycle, stand)")
    p.add_argument("--deterministic", action="store_true", help="stand, gtcp: top-k, not Gumbel")
    p.add_argument(
        "--harvest-rejected",
        action=argparse.BooleanOptionalAction,
        help="stand, gtcp, stand-dyn: also store distributions at rejected tree nodes "
        "(stand-dyn and auto: on unless --no-harvest-rejected)",
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
    if device == "auto" and "torch" not in sys.modules:  # the device decides a method's fields
        with phase("[tts] importing torch (to find the device)", "[tts] torch imported"):
            import torch  # noqa: F401
    try:
        drafter = method_drafter(method, preset.get("drafters", {}), device)
    except ValueError as e:
        raise UsageError(f"--method: {e}") from e
    drafter.update(drafter_flags(args, drafter["kind"], method))
    model = dict(preset.get("model", {}))
    model.update({k: getattr(args, k) for k in ("device", "dtype") if getattr(args, k)})
    if args.model is not None:
        model["name"] = args.model
    sampling = dict(preset.get("sampling", {}))
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "run_nonce", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = tuple(args.stop) if key == "stop" else getattr(args, key)
    given = {k: v for k, v in extra.items() if v is not None}  # the rest: the schema's defaults
    raw = {"model": model, "drafter": drafter, "sampling": sampling, **given}
    try:
        return model_cls.model_validate(raw)
    except ValidationError as e:
        message, size = field_error(e), (size_field(drafter["kind"]) or "").replace("_", "-")
        if args.num_nodes is not None and size and message.startswith(f"--{size}: "):
            message = "--num-nodes: " + message.removeprefix(f"--{size}: ")  # the flag given
        raise UsageError(message) from e


def drafter_flags(args: argparse.Namespace, kind: str, method: str) -> dict:
    """The drafter fields the flags set: `--num-nodes` the kind's size field, the others the
    field of their name. A flag given for a kind without its field is a usage error."""
    fields = DRAFTER_CONFIGS[kind].model_fields
    given = {
        "--tree": ("tree", args.tree),
        "--deterministic": ("stochastic", False if args.deterministic else None),
        "--harvest-rejected": ("harvest_rejected", args.harvest_rejected),
    }
    if args.harvest_rejected is False:  # the flag as given
        given["--no-harvest-rejected"] = given.pop("--harvest-rejected")
    out = {}
    if args.num_nodes is not None:
        name = size_field(kind)
        if name is None:
            raise UsageError(f"--num-nodes: method {method!r} has no draft size to set")
        out[name] = args.num_nodes
    for flag, (name, value) in given.items():
        if value is None:
            continue
        if name not in fields:
            raise UsageError(f"{flag}: method {method!r} takes no {name}")
        out[name] = value
    return out


def typed_flag(args: argparse.Namespace, *names: str) -> str:
    """Which of a flag's `names` the user typed (its first if none): errors name that one."""
    typed = [a.split("=", 1)[0] for a in getattr(args, "argv", [])]
    return next((n for n in names if n in typed), names[0])


def check_tensor_parallel(
    req: GenerateRequest | SolveRequest | ServeConfig, flag: str = "--tensor-parallel"
) -> None:
    """Refuse, before anything loads, ranks that do not divide the model's heads (the error
    names `flag`, as typed)."""
    if req.tensor_parallel == 1:
        return
    from tts_service.model_check import ModelNotFoundError
    from tts_service.models import check_tensor_parallel as check_model

    try:
        check_model(req.model, req.tensor_parallel)
    except ModelNotFoundError as e:
        raise UsageError(f"--model: {e}") from e
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: {e}") from e


def load(req: GenerateRequest | SolveRequest | CalibrateTreeRequest):
    from tts_service.generation import Generator  # heavy: only after validation
    from tts_service.model_check import ModelNotFoundError
    from tts_service.models import resolve_device

    try:
        resolve_device(req.model.device)  # cuda asked on a machine without it
    except ValueError as e:
        raise UsageError(f"--device: {e}") from e
    try:
        return Generator.load(req.model, drafter=getattr(req, "drafter", None))
    except ModelNotFoundError as e:
        raise UsageError(f"--model: {e}") from e
