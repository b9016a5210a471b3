"""Accuracy and speed on AIME-2024, GPQA-Diamond or LiveCodeBench, as a Ray Job entrypoint (or
a plain local run).

    python -m jobs.evaluate --task aime24|gpqa|lcb --n 16 [--method auto] --out results/eval \\
        [--data hub|fixtures | --data-files F ...] [--release release_v5] [--limit K] \\
        [--config configs/best_of_16.yaml] [--set key=value ...] [--test-timeout 6]

`--method` is any name in `tts_service.drafters.methods.METHODS` or `auto` (the default), which
runs, and names the run after, the method it resolves to on the model's device.

Four steps: parse; validate the config, the method and the dataset (anything wrong exits 2 with
one line on stderr, before any actor starts); run every item's N trajectories on the generator
actors; write `<out>/<task>/<method>/items.jsonl`, one graded row per item as it finishes, and
then the report over every run in `<out>` (`tts_service/tasks/report.py`). A re-run skips
graded items and resumes half-done ones from `trajectories.jsonl` in the same directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from actors.placement import PlacementError
from jobs.common import (
    JobInputError,
    Progress,
    first_difference,
    init_ray,
    job_id_for,
    load_config,
    run_pool,
)
from tts_service.config import JobConfig, Problem
from tts_service.drafters.methods import DEFAULT_METHOD, METHOD_NAMES, METHODS, resolve_method
from tts_service.tasks.items import TASK_NAMES, EvalItem, TaskName
from tts_service.tasks.loaders import DEFAULT_RELEASE, DatasetUnavailable, DataSource, load_rows
from tts_service.tasks.prompts import build_items
from tts_service.tasks.sandbox import Limits


@dataclass(frozen=True)
class EvalJob:
    """Everything validated: the run writes into `out / task / method`."""

    cfg: JobConfig
    task: TaskName
    method: str
    items: list[EvalItem]
    out: Path
    run_info: dict  # what run.json records; a resumed run must match it
    limits: Limits

    @property
    def run_dir(self) -> Path:
        return self.out / self.task / self.method


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise JobInputError(message)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="jobs.evaluate", description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--task", required=True, choices=TASK_NAMES)
    ap.add_argument(
        "--method", choices=METHOD_NAMES, default=DEFAULT_METHOD, help="default: %(default)s"
    )
    ap.add_argument("--n", type=int, help="trajectories per item (default: the preset's n)")
    ap.add_argument("--out", required=True, help="runs and the report go here (required)")
    ap.add_argument("--data", choices=["hub", "fixtures"], help="default hub")
    ap.add_argument("--data-files", nargs="+", type=Path, help="local copies, dataset fields")
    ap.add_argument("--release", help=f"LiveCodeBench release (default {DEFAULT_RELEASE})")
    ap.add_argument("--limit", type=int, help="only the first K items")
    ap.add_argument(
        "--config", default="configs/best_of_16.yaml", help="YAML preset (default: %(default)s)"
    )
    ap.add_argument("--set", action="append", default=[], help="override: key.sub=value")
    ap.add_argument(
        "--test-timeout",
        type=float,
        default=6.0,
        help="seconds per code test (default: %(default)s)",
    )
    return ap.parse_args(argv)


def _flags(args: argparse.Namespace):
    """--n as a change to the preset (a --set still wins over it)."""

    def update(data: dict) -> dict:
        if args.n is not None:
            data["n"] = args.n
        return data

    return update


def _source(args: argparse.Namespace) -> DataSource:
    if args.data_files and args.data:
        raise JobInputError("--data-files: give either --data or --data-files")
    source: DataSource = "files" if args.data_files else args.data or "hub"
    if args.release is not None and (source != "hub" or args.task != "lcb"):
        raise JobInputError("--release: only for --task lcb with --data hub")
    return source


def parse(argv: list[str] | None) -> EvalJob:
    """Parse and validate everything, the dataset included; raises JobInputError."""
    args = _arguments(argv)
    cfg = load_config(args.config, args.set, _flags(args), args.method)
    if cfg.early_stop:
        raise JobInputError("early_stop: evaluation needs all N trajectories (pass@k, maj@k)")
    if args.limit is not None and args.limit < 1:
        raise JobInputError(f"--limit: must be >= 1, got {args.limit}")
    if args.test_timeout <= 0:
        raise JobInputError(f"--test-timeout: must be > 0, got {args.test_timeout}")
    method = resolve_method(args.method, cfg.model.device)  # `auto` is named by what it runs
    if METHODS[method].kind != cfg.drafter.kind:
        raise JobInputError(f"drafter.kind: {cfg.drafter.kind!r} is not --method {method}'s")
    source = _source(args)
    release = args.release or DEFAULT_RELEASE
    try:  # last: the Hub may take a while to answer
        rows = load_rows(args.task, source, args.data_files, release)
        items = build_items(args.task, rows, cfg.sampling.seed)
    except DatasetUnavailable as e:
        raise JobInputError(f"--data hub: {e}" if source == "hub" else str(e)) from e
    except ValueError as e:
        raise JobInputError(str(e)) from e
    run_info = {
        "task": args.task,
        "method": method,
        "drafter": cfg.drafter.model_dump(mode="json"),
        "model": cfg.model.name,
        "n": cfg.n,
        "sampling": cfg.sampling.model_dump(mode="json"),
        "chat": cfg.chat,
        "data": source,
        "data_files": [str(p) for p in args.data_files or []],
        "release": release if source == "hub" and args.task == "lcb" else None,
    }
    job = EvalJob(
        cfg,
        args.task,
        method,
        items[: args.limit],
        Path(args.out),
        run_info,
        Limits(timeout_s=args.test_timeout),
    )
    _check_resumable(job)
    return job


def _check_resumable(job: EvalJob) -> None:
    """A directory holds one run: resuming it with other settings would mix two experiments."""
    path = job.run_dir / "run.json"
    if not path.is_file():
        return
    before = json.loads(path.read_text(encoding="utf-8"))
    differs = first_difference({key: before.get(key) for key in job.run_info}, job.run_info)
    if differs:
        raise JobInputError(
            f"--out: {job.run_dir} holds a run with {differs}; use another --out or the same "
            "settings"
        )


def run(job: EvalJob) -> list[Path]:
    """Run what is missing, then write the report; returns the report's paths."""
    from actors.pool import ResultsFile
    from tts_service.tasks import report
    from tts_service.tasks.grading import grade_item
    from tts_service.tasks.sandbox import protections

    job.run_dir.mkdir(parents=True, exist_ok=True)
    info = dict(job.run_info, sandbox=protections() if job.task == "lcb" else None)
    (job.run_dir / "run.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    if info["sandbox"]:
        print(f"[eval] sandbox: {json.dumps(info['sandbox'])}", flush=True)
    graded = ResultsFile(job.run_dir / "items.jsonl", key="id", key_type=str)
    done = {row["id"] for row in graded.load()}
    todo = {item.id: item for item in job.items if item.id not in done}
    print(
        f"[eval] {job.task}/{job.method}: {len(job.items)} items, {len(job.items) - len(todo)} "
        f"already graded, {len(todo)} to run, n={job.cfg.n}",
        flush=True,
    )
    if todo:
        init_ray(job.cfg)
        progress = Progress(job.cfg.n * len(todo), len(todo))

        def on_problem(state) -> None:
            progress.problems += 1
            row = grade_item(todo[state.problem.id], list(state.records.values()), job.limits)
            graded.append(row)
            print(
                f"[eval] item {row['id']}: {sum(row['correct'])}/{len(row['correct'])} correct, "
                f"vote {'correct' if row['maj_correct'][str(job.cfg.n)] else 'wrong'}",
                flush=True,
            )

        problems = [
            Problem(id=i.id, question=i.prompt, task=i.answer_kind, answer=i.answer)
            for i in todo.values()
        ]
        trajectories = job.run_dir / "trajectories.jsonl"
        run_pool(
            job.cfg,
            problems,
            trajectories,
            job_id_for(job.run_dir),
            progress.trajectory,
            on_problem,
        )
    paths = report.write(job.out)
    for run_info in json.loads(paths[0].read_text())["runs"] if paths else []:
        m = run_info["metrics"]
        print(
            f"[eval] {run_info['task']}/{run_info['method']}: items {m['items']} "
            f"pass@1 {m['pass@1']['value']:.3f} maj@{m['n']} {m['maj@n']['value']:.3f} "
            f"pass@{m['n']} {m['pass@n']['value']:.3f} tokens/s {m['tokens_per_s']['value']:.1f} "
            f"acceptance length {m['acceptance_length']['value']:.2f}",
            flush=True,
        )
    print(f"[eval] report: {', '.join(str(p) for p in paths)}", flush=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse(argv))
    except (JobInputError, PlacementError) as e:
        print(f"jobs.evaluate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
