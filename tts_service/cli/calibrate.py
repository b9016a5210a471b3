"""`tts calibrate-tree`: a data-driven STAND tree, from live trajectories or a trajectory log."""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from tts_service.cli.common import UsageError, field_error, load
from tts_service.config import CalibrateTreeRequest


def add_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate-tree", help="data-driven STAND tree (625 nodes -> best K)")
    cal.add_argument("--prompts", default="configs/calibration.jsonl", help="live calibration")
    cal.add_argument("--trajectories", help="replay this trajectory log instead (no model)")
    cal.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    cal.add_argument("--init-tree", default="stand-625")
    cal.add_argument("--nodes", type=int, default=80)
    cal.add_argument("--out", default="configs/trees/stand-80.json")
    cal.add_argument("--model")
    cal.add_argument("--temperature", type=float)
    cal.add_argument("--max-new-tokens", type=int)
    cal.add_argument("--seed", type=int)
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
