"""`tts replay`: a drafter's acceptance length on a trajectory log, offline, with no model."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from tts_service.cli.common import field_error
from tts_service.cli.usage import UsageError
from tts_service.drafters.registry import REPLAY_METHODS
from tts_service.schemas import ReplayRequest


def add_arguments(rep: argparse.ArgumentParser) -> None:
    rep.add_argument("--method", required=True, help=", ".join(REPLAY_METHODS))
    rep.add_argument("--trajectories", required=True, help="JSONL trajectory log (.gz too)")
    rep.add_argument("--tree", help="tree shape name or JSON path (static-tree methods)")
    rep.add_argument("--nodes", type=int, help="draft node cap per step (pld: chain length)")
    rep.add_argument("--vocab-size", type=int, help="reject token ids >= this")
    rep.add_argument("--strict", action="store_true", help="reject the file at a bad line")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raw = {
        "method": args.method,
        "trajectories": args.trajectories,
        "tree": args.tree,
        "nodes": args.nodes,
        "vocab_size": args.vocab_size,
        "strict": args.strict,
    }
    try:
        req = ReplayRequest.model_validate({k: v for k, v in raw.items() if v is not None})
    except ValidationError as e:
        raise UsageError(field_error(e)) from e
    from tts_service.replay import MAX_NODES, LogFormatError, read_log, replay, replay_config

    try:
        problems, errors = read_log(req.trajectories, req.vocab_size, req.strict)
    except LogFormatError as e:
        raise UsageError(str(e)) from e
    for err in errors:
        print(f"tts replay: skipped {err}", file=sys.stderr)
    try:
        cfg = replay_config(req)
    except ValidationError as e:
        raise UsageError(field_error(e)) from e
    report = replay(problems, cfg, req.nodes or MAX_NODES, req.vocab_size)
    out = {
        "method": req.method,
        "problems": len(problems),
        "skipped_lines": len(errors),
        **report.to_dict(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0
