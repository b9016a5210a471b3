"""`tts job`: submit and follow best-of-N Ray jobs; a thin client of Ray's job server, so Ray
is imported only when a server is contacted.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from tts_service.cli.common import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    job = sub.add_parser("job", help="submit and follow best-of-N Ray jobs")
    job.add_argument("action", choices=["submit", "status", "logs", "results"])
    job.add_argument("job_id", nargs="?", help="status, logs: the job id submit printed")
    job.add_argument(
        "--address",
        help="Ray job server (default $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)",
    )
    job.add_argument("--working-dir", default=".", help="submit: uploaded to the cluster")
    job.add_argument("--out", help="results: the job's --out directory")
    job.add_argument("rest", nargs=argparse.REMAINDER, help="submit: -- ENTRYPOINT ...")
    job.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """A thin wrapper over Ray's JobSubmissionClient (RAY_AUTH_MODE decides token auth)."""
    if args.action == "results":
        if not args.out:
            raise UsageError("--out: the job's output directory is needed for results")
        # best_of_n writes summary.json; evaluate writes report.md
        found = [Path(args.out, n) for n in ("summary.json", "report.md")]
        found = [p for p in found if p.is_file()]
        if not found:
            raise UsageError(
                f"--out: no summary.json or report.md in {args.out} (job still running?)"
            )
        print(found[0].read_text())
        return 0
    from ray.job_submission import JobSubmissionClient

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"
    try:
        client = JobSubmissionClient(address)
    except (ConnectionError, RuntimeError) as e:
        raise UsageError(f"--address: cannot reach the Ray job server at {address}: {e}") from e
    if args.action == "submit":
        # after `--`, argparse gives the entrypoint's first word to the optional job_id
        entry = [a for a in (args.job_id, *args.rest) if a not in (None, "--")]
        if not entry:
            raise UsageError(
                "entrypoint: give the command after --, e.g. -- python -m "
                "jobs.best_of_n --problems p.jsonl --out results/"
            )
        env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TTS_STORE_URL") if k in os.environ}
        job_id = client.submit_job(
            entrypoint=" ".join(shlex.quote(a) for a in entry),
            runtime_env={
                "working_dir": args.working_dir,
                "env_vars": env,
                "excludes": [".venv", "runs", ".git", "results"],
            },
        )
        print(job_id)
    elif args.action == "status":
        print(client.get_job_status(args.job_id).value)
    elif args.action == "logs":
        print(client.get_job_logs(args.job_id), end="")
    return 0
