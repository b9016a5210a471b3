"""`tts solve`: best-of-N trajectories of one question or a problems file, sharing one n-gram
store per problem, then the vote; the whole pipeline in one process, without Ray (but for
`--tensor-parallel G`: this process is rank 0, the other ranks Ray actors).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from tts_service.aggregate.confidence import AGGREGATES
from tts_service.cli.common import (
    add_common_flags,
    add_field,
    check_tensor_parallel,
    load,
    request,
)
from tts_service.cli.store import store_flags, store_server
from tts_service.cli.usage import UsageError
from tts_service.schemas import SolveRequest, read_problems
from tts_service.timing import first_token, phase, process_started, with_setup

if TYPE_CHECKING:
    from tts_service.engine.batch import BatchDecoder
    from tts_service.generation import Generator
    from tts_service.solve import Trajectory


def add_arguments(sol: argparse.ArgumentParser) -> None:
    sol.add_argument("question", nargs="?", help="the problem text (or --problems FILE)")
    add_field(sol, SolveRequest, "problems")
    add_field(sol, SolveRequest, "task")
    add_common_flags(sol, SolveRequest)
    add_field(sol, SolveRequest, "n")
    add_field(sol, SolveRequest, "early_stop", action=argparse.BooleanOptionalAction)
    add_field(sol, SolveRequest, "confidence", action=argparse.BooleanOptionalAction)
    add_field(sol, SolveRequest, "aggregate", choices=AGGREGATES)
    sol.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    sol.add_argument("--log", help="append the trajectories to this JSONL trajectory log")
    add_field(sol, SolveRequest, "max_rows", type=int)
    add_field(sol, SolveRequest, "tensor_parallel")
    sol.add_argument(
        "--store",
        help="redis://host:port/db or local-redis (default: in-process or $TTS_STORE_URL)",
    )
    sol.add_argument(
        "--store-fallback",
        action="store_true",
        help="if Redis is unreachable at start, go on with a local store",
    )
    sol.add_argument("--prompt-id", default="q0", help="the problem's id in the log")
    sol.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.question is None) == (args.problems is None):
        raise UsageError("--problems: give one QUESTION or --problems FILE (not both)")
    req = request(
        args,
        SolveRequest,
        {
            "question": args.question,
            "problems": args.problems,
            "task": args.task,
            "n": args.n,
            "early_stop": args.early_stop,
            "confidence": args.confidence,
            "aggregate": args.aggregate,
            "chat": not args.no_chat,
            "max_rows": args.max_rows,
            "store": store_flags(args),
            "tensor_parallel": args.tensor_parallel,
        },
    )
    check_tensor_parallel(req)
    if req.problems is not None:
        try:
            questions = [(p.id, p.question) for p in read_problems(req.problems)]
        except ValueError as e:
            raise UsageError(f"--problems: {e}") from e
    else:
        questions = [(args.prompt_id, req.question)]
    with store_server(req.store) as url:  # a store that does not answer fails before the load
        problems, solved = _solve(req, questions, url, record=args.log is not None)
    if args.log is not None:
        from tts_service.replay import LogWriter, logged_problem

        writer = LogWriter(Path(args.log))
        for problem, result in zip(problems, solved.problems, strict=True):
            writer.write(logged_problem(problem.prompt_ids, result))
    out = solved.to_dict(req.task, req.aggregate)
    out["stats"] = with_setup(out["stats"], process_started())
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        for p in out["problems"]:
            for t in p["trajectories"]:
                print(f"--- {p['id']} trajectory {t['index']} ({t['finish_reason']}) ---")
                print(t["text"])
            cut = f", decoded {p['decoded']} of {p['n']}" if p.get("stopped_early") else ""
            if "aggregate" in p:
                cut += f", by {p['aggregate']} (majority: {p['majority']!r})"
            print(f"=== {p['id']}: answer {p['answer']!r}, votes {p['votes']}{cut} ===")
        print(json.dumps(out["stats"]), file=sys.stderr)
    return 0


def _solve(req: SolveRequest, questions: list[tuple[str, str]], url: str | None, record: bool):
    """Load the model (this process as rank 0 of `--tensor-parallel` ranks, the others Ray
    actors) and run every question's trajectories on one host; (problem inputs, results)."""
    if req.tensor_parallel == 1:
        with phase(f"[tts] loading model {req.model.name}", "[tts] model loaded"):
            gen = load(req)
        return _solve_with(gen, None, req, questions, url, record)
    import os

    from actors.cluster import connect
    from actors.tp import TensorParallelLeader

    with phase("[tts] starting Ray", "[tts] Ray ready"):
        connect(num_cpus=max(req.tensor_parallel, os.cpu_count() or 1))
    with phase(
        f"[tts] loading model {req.model.name} on {req.tensor_parallel} ranks", "[tts] ranks ready"
    ):
        leader = TensorParallelLeader(req.model, req.tensor_parallel)
    try:
        return _solve_with(leader.generator, leader.decoder, req, questions, url, record)
    finally:
        leader.close()


def _solve_with(
    gen: Generator,
    tp_decoder: BatchDecoder | None,
    req: SolveRequest,
    questions: list[tuple[str, str]],
    url: str | None,
    record: bool,
):
    """Every question's trajectories on one `RunnerHost` over `gen` (and a tensor-parallel
    leader's decoder)."""
    from actors.host import RunnerHost
    from store.factory import problem_id
    from store.redis_client import StoreUnavailableError
    from tts_service.aggregate.early_stop import EarlyStop
    from tts_service.drafters.registry import VerifyKeyReusedError
    from tts_service.generation import InputTooLongError
    from tts_service.solve import ProblemInput, solve_problems

    progress = TokenProgress(req.n * len(questions), req.sampling.max_new_tokens)
    try:
        try:
            host = RunnerHost(gen, req.store, url, req.max_rows, tp_decoder=tp_decoder)
            problems = []
            for pid, question in questions:
                ids = gen.encode(question, chat=req.chat)
                problems.append(ProblemInput(pid, ids, host.problem_store(problem_id(ids))))
        except StoreUnavailableError as e:
            raise UsageError(f"--store: {e}") from e
        try:  # solve_problems closes the problem stores
            solved = solve_problems(
                host,
                problems,
                req.n,
                req.drafter,
                req.sampling,
                on_trajectory=progress.trajectory,
                record=record,
                on_commit=progress.commit,
                early_stop=EarlyStop(req.n, req.task) if req.early_stop else None,
                confidence=req.confidence,
            )
        finally:  # while a local-redis server still runs
            host.close()
    except InputTooLongError as e:
        raise UsageError(f"question: {e}") from e
    except VerifyKeyReusedError as e:
        raise UsageError(f"--run-nonce: {e}") from e
    finally:
        progress.bar.close()
    return problems, solved


class TokenProgress:
    """A tqdm bar over tokens on a terminal (none elsewhere): every step's committed tokens out
    of `max_new_tokens` per trajectory, a finished trajectory's unused budget taken off the
    total; and one status line at the first token, the end of the wait before decoding."""

    def __init__(self, trajectories: int, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.trajectories = trajectories
        self.finished = self.tokens = 0
        self.bar = tqdm(
            total=trajectories * max_new_tokens,
            desc="tokens",
            unit="tok",
            file=sys.stderr,
            disable=None,
        )

    def commit(self, tokens: Sequence[int]) -> bool:
        """A step's tokens of any trajectory (True: never cancels)."""
        if self.tokens == 0:
            first_token()
        self.tokens += len(tokens)
        self.bar.update(len(tokens))
        return True

    def trajectory(self, _problem_id: str, t: Trajectory) -> None:
        self.finished += 1
        self.bar.total -= self.max_new_tokens - t.output.stats.new_tokens
        self.bar.set_postfix_str(
            f"trajectories {self.finished}/{self.trajectories} "
            f"acc_len {t.output.stats.acceptance_length:.2f}"
        )
