"""`tts job`: submit and follow Ray jobs; a thin client of Ray's job server (`ray job ...` with
the repository as working directory), so Ray is imported only when a server is contacted.
Options follow their action, as in `ray job`: `tts job logs --follow --address A JOB_ID`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

from tts_service.cli.usage import UsageError

ENTRYPOINT_HINT = "-- python -m jobs.best_of_n --problems p.jsonl --out $PWD/results/job1"


def add_arguments(job: argparse.ArgumentParser) -> None:
    job.description = "Submit and follow Ray jobs (a thin wrapper over Ray's JobSubmissionClient)."
    actions = job.add_subparsers(dest="action", required=True, parser_class=type(job))
    submit = _action(actions, "submit", "submit ENTRYPOINT (after --); prints the job id")
    submit.add_argument(
        "--working-dir", default=".", help="uploaded to the cluster (default: %(default)s)"
    )
    submit.add_argument("entrypoint", nargs=argparse.REMAINDER, help=ENTRYPOINT_HINT)
    for name, text in (
        ("status", "the job's status (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)"),
        ("logs", "the job's logs so far (--follow: until it ends)"),
        ("stop", "stop a running job"),
    ):
        p = _action(actions, name, text)
        p.add_argument("job_id", help="the id `tts job submit` printed")
        if name == "logs":
            p.add_argument("-f", "--follow", action="store_true", help="stream until the job ends")
    _action(actions, "list", "every job the server knows: id, status, entrypoint")
    results = actions.add_parser("results", help="print a finished job's summary.json or report.md")
    results.add_argument("--out", required=True, help="the job's --out directory")
    results.set_defaults(func=show_results)


def _action(actions: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    p = actions.add_parser(name, help=text, description=text)
    p.add_argument(
        "--address",
        help="Ray job server (default $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)",
    )
    p.set_defaults(func=run)
    return p


def show_results(args: argparse.Namespace) -> int:
    """best_of_n writes summary.json; evaluate writes report.md."""
    found = [p for p in (Path(args.out, n) for n in ("summary.json", "report.md")) if p.is_file()]
    if not found:
        raise UsageError(f"--out: no summary.json or report.md in {args.out} (job still running?)")
    print(found[0].read_text())
    return 0


def entrypoint(args: argparse.Namespace) -> str:
    """The shell command after `--`, quoted as it was given (raises UsageError if none)."""
    words = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    if not words:
        raise UsageError(f"entrypoint: give the command after --, e.g. {ENTRYPOINT_HINT}")
    return " ".join(shlex.quote(a) for a in words)


def check_entry_model(words: list[str]) -> None:
    """The model a jobs entrypoint names (`--model X`, `--set model.name=X`), checked here before
    the job is submitted (a typo is exit 2 now, not an actor's death on the cluster). The job's
    nodes load it, so a hub id that this machine neither caches nor reaches passes, warned."""
    if not any(w in ("jobs.best_of_n", "jobs.evaluate") for w in words):
        return
    named = [b for a, b in zip(words, words[1:], strict=False) if a == "--model"]
    named += [w.split("=", 1)[1] for w in words if w.startswith(("model.name=", "--model="))]
    from tts_service.model_check import ModelNotFoundError, check_model

    for name in named:
        try:
            warning = check_model(name, here=False)
        except ModelNotFoundError as e:
            raise UsageError(f"entrypoint: {e}") from e
        if warning:
            print(f"tts: warning: {warning}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """One call of Ray's JobSubmissionClient (RAY_AUTH_MODE decides token auth)."""
    entry = entrypoint(args) if args.action == "submit" else ""
    if entry:
        check_entry_model(shlex.split(entry))
    from ray.job_submission import JobSubmissionClient

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"
    try:
        client = JobSubmissionClient(address)
    except (ConnectionError, RuntimeError) as e:
        raise UsageError(f"--address: cannot reach the Ray job server at {address}: {e}") from e
    try:
        if args.action == "submit":
            env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TTS_STORE_URL") if k in os.environ}
            print(
                client.submit_job(
                    entrypoint=entry,
                    runtime_env={
                        "working_dir": args.working_dir,
                        "env_vars": env,
                        "excludes": [".venv", "runs", ".git", "results"],
                    },
                )
            )
        elif args.action == "list":
            for info in client.list_jobs():
                print(f"{info.submission_id}\t{info.status.value}\t{info.entrypoint}")
        else:
            status = client.get_job_status(args.job_id)  # a missing job fails here, with 404
            if args.action == "status":
                print(status.value)
            elif args.action == "stop":
                stopped = client.stop_job(args.job_id)
                print("stopped" if stopped else f"not running ({status.value})")
            elif args.follow:
                try:
                    asyncio.run(_follow(client, args.job_id))
                except KeyboardInterrupt:  # stops following; the job goes on
                    return 130
            else:
                print(client.get_job_logs(args.job_id), end="")
    except RuntimeError as e:
        if "status code 404" in str(e):
            raise UsageError(f"job_id: no job {args.job_id!r} on {address}") from e
        raise UsageError(f"--address: the Ray job server at {address} failed: {e}") from e
    return 0


async def _follow(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        print(chunk, end="", flush=True)
