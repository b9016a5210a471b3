"""`tts generate`: one generation with a speculative method, to try a method on a prompt."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from tts_service.cli.common import (
    add_common_flags,
    add_field,
    check_tensor_parallel,
    load,
    request,
)
from tts_service.cli.usage import UsageError
from tts_service.schemas import GenerateRequest
from tts_service.textstream import StableText
from tts_service.timing import first_token, phase, process_started, with_setup


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", help="the prompt text")
    add_common_flags(gen, GenerateRequest)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_field(gen, GenerateRequest, "tensor_parallel")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    req = request(
        args,
        GenerateRequest,
        {"prompt": args.prompt, "chat": args.chat, "tensor_parallel": args.tensor_parallel},
    )
    if req.tensor_parallel > 1:
        result, shown = _generate_tensor_parallel(req), None
    else:
        result, shown = _generate(req, stream=not args.json)
    result["stats"] = with_setup(result["stats"], process_started())
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:  # the text printed as it committed (all at the end on tensor-parallel ranks)
        print(result["text"] if shown is None else shown.finish(result["text"]))
        print(json.dumps(result["stats"]), file=sys.stderr)
    return 0


def _generate(req: GenerateRequest, stream: bool) -> tuple[dict, StableText | None]:
    """One generation in this process: (its result, the text printed as it committed, when
    `stream`)."""
    with phase(f"[tts] loading model {req.model.name}", "[tts] model loaded"):
        gen = load(req)  # the model libraries' imports included
    from actors.host import RunnerHost
    from tts_service.generation import InputTooLongError

    host = RunnerHost(gen, max_rows=1)
    shown = StableText(gen.decode, req.sampling.stop) if stream else None
    steps = None if shown is None else lambda tokens: _show(shown, tokens)
    try:
        ids = gen.encode(req.prompt, req.chat)
        return host.generate(ids, req.drafter, req.sampling, steps).to_dict(), shown
    except InputTooLongError as e:
        raise UsageError(f"prompt: {e}") from e


def _show(text: StableText, tokens: Sequence[int]) -> bool:
    """Print a step's final text as it commits (the first token announced on stderr)."""
    if not text.ids:
        first_token()
    sys.stdout.write(text.commit(tokens))
    sys.stdout.flush()
    return True


def _generate_tensor_parallel(req: GenerateRequest) -> dict:
    """One generation on a replica of `req.tensor_parallel` Ray rank actors (the Ray of
    `actors.cluster.connect`)."""
    import os

    check_tensor_parallel(req)
    from actors.cluster import connect
    from actors.tp import TensorParallelReplica

    with phase("[tts] starting Ray", "[tts] Ray ready"):
        connect(num_cpus=max(req.tensor_parallel, os.cpu_count() or 1))
    with phase(
        f"[tts] loading model {req.model.name} on {req.tensor_parallel} ranks", "[tts] ranks ready"
    ):
        replica = TensorParallelReplica(req.model, req.tensor_parallel)
    from tts_service.generation import InputTooLongError

    try:
        return replica.generate(req.prompt, req.drafter, req.sampling, req.chat)
    except InputTooLongError as e:
        raise UsageError(f"prompt: {e}") from e
    finally:
        replica.close()
