"""`tts generate`: one generation with a speculative method, to try a method on a prompt."""

from __future__ import annotations

import argparse
import json
import sys

from tts_service.cli.common import UsageError, add_common_flags, load, request
from tts_service.config import GenerateRequest


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="one generation with a speculative method")
    gen.add_argument("prompt", help="the prompt text")
    add_common_flags(gen, GenerateRequest)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    req = request(args, GenerateRequest, {"prompt": args.prompt, "chat": args.chat})
    gen = load(req)
    from tts_service.generation import InputTooLongError

    try:
        result = gen.generate(req.prompt, req.drafter, req.sampling, chat=req.chat)
    except InputTooLongError as e:
        raise UsageError(f"prompt: {e}") from e
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        print(result.text)
        print(json.dumps(result.stats.to_dict()), file=sys.stderr)
    return 0
