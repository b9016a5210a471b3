"""`tts calibrate-tree`: a data-driven STAND tree, from live trajectories or a trajectory log."""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from tts_service.cli.common import add_field, field_error, load, with_default
from tts_service.cli.usage import UsageError
from tts_service.schemas import CalibrateTreeRequest


def add_arguments(cal: argparse.ArgumentParser) -> None:
    cal.add_argument(
        "--prompts",
        default="configs/calibration.jsonl",
        help=with_default(CalibrateTreeRequest.model_fields["prompts"].description, "%(default)s"),
    )
    add_field(cal, CalibrateTreeRequest, "trajectories")
    for path in ("n", "init_tree", "nodes"):
        add_field(cal, CalibrateTreeRequest, path)
    cal.add_argument(
        "--out",
        default="configs/trees/stand-80.json",
        help=with_default(CalibrateTreeRequest.model_fields["out"].description, "%(default)s"),
    )
    add_field(cal, CalibrateTreeRequest, "model.name", flag="--model")
    for path in ("sampling.temperature", "sampling.max_new_tokens", "sampling.seed"):
        add_field(cal, CalibrateTreeRequest, path)
    cal.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sampling = {
        k: getattr(args, k)
        for k in ("temperature", "max_new_tokens", "seed")
        if getattr(args, k) is not None
    }
    raw = {
        "prompts": None if args.trajectories else args.prompts,
        "trajectories": args.trajectories,
        "n": args.n,
        "init_tree": args.init_tree,
        "nodes": args.nodes,
        "out": args.out,
        "sampling": sampling,
        "model": {"name": args.model} if args.model else {},
    }
    raw = {k: v for k, v in raw.items() if v is not None}  # the rest: the schema's defaults
    try:
        req = CalibrateTreeRequest.model_validate(raw)
    except ValidationError as e:
        raise UsageError(field_error(e)) from e
    from tts_service.calibrate import calibrate, calibrate_from_log

    if req.trajectories is not None:
        from tts_service.replay import LogFormatError, read_log

        try:
            problems, _ = read_log(req.trajectories, strict=True)
        except LogFormatError as e:
            raise UsageError(str(e)) from e
        tree = calibrate_from_log(req, problems)
    else:
        tree = calibrate(load(req), req)
    print(
        json.dumps(
            {
                "out": str(req.out),
                "num_nodes": len(tree.parents) - 1,
                "expected_acceptance_length": round(tree.expected_acceptance_length, 4),
            }
        )
    )
    return 0
