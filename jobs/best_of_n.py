"""Best-of-N over a problems file, as a Ray Job entrypoint (or a plain local run).

    python -m jobs.best_of_n --config configs/best_of_16.yaml --problems problems.jsonl \\
        --out results/ [--method auto] [--set sampling.temperature=0.7 --set n=8 ...] [--log]

Four steps only: parse, validate (a bad field exits 2 before any actor starts), run the pool,
write results. Writes `run.json` (the settings, which a resume must match), `trajectories.jsonl`
(every trajectory as it finishes; the resume point), `problems/<id>.json` (answer, votes,
correct, trajectories, stats), and at the end `results.jsonl` and `summary.json`.
"""

from __future__ import annotations

from tts_service import startup

if __name__ == "__main__":  # a process starting here: no collector passes over its imports
    startup.hold()

import argparse
import hashlib
import json
import sys
import time
from itertools import count
from pathlib import Path

from actors.placement import PlacementError
from jobs.actor_set import run_missing
from jobs.common import (
    JOB_PRESET,
    MODEL_HELP,
    JobInputError,
    Progress,
    check_run,
    first_difference,
    job_id_for,
    load_config,
    output_dir,
    run_settings,
    stopped,
    with_model,
)
from tts_service.drafters.registry import METHOD_NAMES, method_name
from tts_service.engine.metrics import acceptance_length
from tts_service.schemas import JobConfig, Problem, read_problems
from tts_service.tasks.report import truncation_warning
from tts_service.timing import TIMING_KEYS, process_started, with_setup


def load_problems(path: Path) -> list[Problem]:
    try:
        return read_problems(path)
    except ValueError as e:
        raise JobInputError(f"--problems: {e}") from e


def parse(argv: list[str] | None) -> tuple[JobConfig, list[Problem], Path]:
    ap = argparse.ArgumentParser(
        prog="jobs.best_of_n", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument(
        "--config",
        type=Path,
        default=JOB_PRESET,
        help="YAML preset (default: the repository's configs/best_of_16.yaml)",
    )
    ap.add_argument("--problems", required=True, help="JSONL, one problem per line (required)")
    ap.add_argument("--out", required=True, help="results go here; a re-run resumes (required)")
    ap.add_argument("--method", choices=METHOD_NAMES, help="over the preset's method (there: auto)")
    ap.add_argument("--model", help=MODEL_HELP)
    ap.add_argument("--set", action="append", default=[], help="override: key.sub=value")
    ap.add_argument(
        "--log",
        action="store_true",
        help="also write <out>/trajectory-log.jsonl, the trajectories with the target's top-k "
        "(tts replay's input; the same as --set log_trajectories=true)",
    )
    ap.add_argument(
        "--new-run",
        action="store_true",
        help="if --out holds a run with other settings, use the first of <out>-2, <out>-3, ... "
        "that is new or holds a run with these settings",
    )
    args = ap.parse_args(argv)
    overrides = [*args.set, "log_trajectories=true"] if args.log else args.set
    cfg = load_config(args.config, overrides, with_model(args.model), args.method)
    problems = load_problems(Path(args.problems))
    check_run(cfg)
    out = output_dir(args.out)
    if args.new_run:
        candidates = (out if k == 1 else Path(f"{out}-{k}") for k in count(1))
        out = next(c for c in candidates if resume_conflict(c, cfg, problems) is None)
    return cfg, problems, out


def _question_digests(problems: list[Problem]) -> dict[str, str]:
    return {p.id: hashlib.sha1(p.question.encode()).hexdigest()[:16] for p in problems}


def resume_conflict(out: Path, cfg: JobConfig, problems: list[Problem]) -> str | None:
    """Why `out` cannot take this run (None: it is new, or it holds this run to resume).

    Trajectories are reused by (problem id, index), so a resume must have the settings that made
    them (`jobs.common.run_settings`) and the same question under each id it shares."""
    path = out / "run.json"
    if not path.is_file():
        found = (out / "trajectories.jsonl").exists()
        return "trajectories with no run.json (their settings are unknown)" if found else None
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
        settings, questions = before["settings"], before["questions"]
    except (OSError, ValueError, TypeError, KeyError):
        return "a run.json that cannot be read"
    differs = first_difference(with_defaults(settings), run_settings(cfg))
    if differs:
        return f"a run with {differs}"
    for pid, digest in _question_digests(problems).items():
        if questions.get(pid, digest) != digest:
            return f"a run where problem {pid!r} has another question"
    return None


def with_defaults(settings: dict) -> dict:
    """A recorded run's settings with the top-level fields added since it ran at their
    defaults (an older run resumes as long as it differs in nothing it knew)."""
    added = {k: v for k, v in run_settings(JobConfig()).items() if k not in settings}
    return added | settings


def claim_run_dir(out: Path, cfg: JobConfig, problems: list[Problem]) -> None:
    """Record the run's settings in `out/run.json`, or refuse a directory holding another run.

    Raises:
        JobInputError: `out` holds another run (the message names the differing field).
    """
    conflict = resume_conflict(out, cfg, problems)
    if conflict:
        raise JobInputError(
            f"--out: {out} holds {conflict}; use the same settings, another --out, or --new-run"
        )
    path = out / "run.json"
    questions = json.loads(path.read_text(encoding="utf-8"))["questions"] if path.is_file() else {}
    (out / "problems").mkdir(parents=True, exist_ok=True)
    info = {"settings": run_settings(cfg), "questions": questions | _question_digests(problems)}
    path.write_text(json.dumps(info, indent=1), encoding="utf-8")


def summarize(states: dict, cfg: JobConfig, progress: Progress, started: float) -> dict:
    """The run's totals; tokens/s counts only what this run generated, not resumed work, over
    the whole wall time from `started` (`tokens_per_s`) and over the decoding alone
    (`decode_tokens_per_s`: from the actors' readiness to the last trajectory)."""
    timing = with_setup(progress.summary(), started)
    tokens = sum(r["stats"]["new_tokens"] for s in states.values() for r in s.records.values())
    forwards = sum(
        r["stats"]["target_forwards"] for s in states.values() for r in s.records.values()
    )
    graded = [s for s in states.values() if s.problem.answer is not None]
    correct = sum(1 for s in graded if s.result and s.result.get("correct"))
    trajectories = sum(len(s.records) for s in states.values())
    truncated = sum(
        r["finish_reason"] == "length" for s in states.values() for r in s.records.values()
    )
    return {
        "problems": len(states),
        "trajectories": trajectories,
        "resumed_trajectories": trajectories - progress.trajectories,
        "accuracy": correct / len(graded) if graded else None,
        "graded": len(graded),
        "total_tokens": tokens,
        "mean_acceptance_length": acceptance_length(tokens, forwards),
        "plain_steps": sum(
            r["stats"].get("plain_steps", 0) for s in states.values() for r in s.records.values()
        ),
        "row_forwards": forwards,
        "truncated": round(truncated / trajectories, 4) if trajectories else 0.0,
        **{k: timing[k] for k in TIMING_KEYS},
        "method": method_name(cfg.drafter),
        "n": cfg.n,
    }


def with_sessions(summary: dict, new_tokens: int, path: Path) -> dict:
    """`summary` with every run into this `--out` kept in `sessions` (when it started, how long
    it took, what it decoded), the earlier ones read from `path`. The top-level timing is the
    latest session's that decoded anything: a re-run with nothing to run records itself and
    keeps the run's speed."""
    before = json.loads(path.read_text()) if path.is_file() else {}
    sessions = before.get("sessions") or ([_session(before)] if "wall_s" in before else [])
    began = time.gmtime(time.time() - summary["wall_s"])
    now = _session(summary) | {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", began),
        "new_tokens": new_tokens,
    }
    sessions.append(now)
    timed = next((x for x in reversed(sessions) if x.get("new_tokens", 1) > 0), now)
    return summary | {k: timed[k] for k in TIMING_KEYS} | {"sessions": sessions}


def _session(summary: dict) -> dict:
    return {k: summary[k] for k in ("started", "new_tokens", *TIMING_KEYS) if k in summary}


def plain_steps_line(summary: dict, cfg: JobConfig) -> str | None:
    """Why a drafting method ran most of its steps plain, when it did (`auto` at the quick
    start's 32 rows on a CPU): in a few words, for the summary."""
    if cfg.drafter.kind == "plain" or summary["plain_steps"] * 2 <= summary["row_forwards"]:
        return None
    share = summary["plain_steps"] / summary["row_forwards"]
    if getattr(cfg.drafter, "sizing", None) == "gt" or cfg.drafter.kind == "gtcp":
        why = (
            "its measured verify cost on this device, at these rows a step, paid for no draft "
            "(the GT rule); fewer rows a step (--set max_rows=N) or a GPU drafts more"
        )
    else:
        why = "the store held no continuation to draft"
    return f"[job] {summary['method']} ran {share:.0%} of its steps plain: {why}"


def problem_result(state, cfg: JobConfig) -> dict:
    from tts_service.aggregate import is_correct
    from tts_service.aggregate.confidence import labelled_vote

    answers = state.answers()
    order = sorted(state.records)
    recs = [state.records[i] for i in order]
    sure = [r.get("confidence") for r in recs]
    vote = labelled_vote(cfg.aggregate, answers, sure, order, state.problem.task)
    tokens = sum(r["stats"]["new_tokens"] for r in recs)
    forwards = sum(r["stats"]["target_forwards"] for r in recs)
    correct = None
    if state.problem.answer is not None and state.problem.task != "code":
        correct = is_correct(vote["answer"], state.problem.answer, state.problem.task)
    return {
        "id": state.problem.id,
        **vote,
        "correct": correct,
        "stopped_early": state.stopped_early,
        "decoded": len(recs),
        "n": cfg.n,
        "cut": [i for i in range(cfg.n) if i not in state.records],  # stopped before they ended
        "trajectories": [
            {
                **{k: v for k, v in r.items() if k not in ("top_ids", "top_probs", "prompt_ids")},
                "answer": a,
            }
            for r, a in zip(recs, answers, strict=True)
        ],
        "stats": {
            "trajectories": len(recs),
            "new_tokens": tokens,
            "target_forwards": forwards,
            "acceptance_length": acceptance_length(tokens, forwards),
        },
    }


def problem_line(result: dict, problem: Problem) -> str:
    """The vote in one line: what won, by how much, and against the reference if known."""
    n = result["stats"]["trajectories"]
    won = round(result["share"] * n)
    line = (
        f"[job] problem {problem.id}: vote {result['answer']!r}, share {result['share']:.2f} "
        f"({won} of {n}), votes {result['votes']}, no answer {result['no_answer']}"
    )
    if result.get("stopped_early") and n < result["n"]:
        line += f", decoded {n} of {result['n']} (the vote was decided)"
    if problem.answer is not None:
        line += f", reference {problem.answer!r}, correct {result['correct']}"
    return line


def write_log_line(state, path: Path) -> None:
    """The problem as one line of a trajectory log (`tts replay` reads it)."""
    from tts_service.replay import LoggedProblem, LogWriter

    recs = [state.records[i] for i in sorted(state.records)]
    if not recs or any("top_ids" not in r for r in recs):
        return  # resumed from a run without logging: nothing complete to write
    LogWriter(path).write(
        LoggedProblem(
            state.problem.id,
            recs[0]["prompt_ids"],
            [r["token_ids"] for r in recs],
            [r["top_ids"] for r in recs],
            [r["top_probs"] for r in recs],
        )
    )


def run(cfg: JobConfig, problems: list[Problem], out: Path, started: float | None = None) -> dict:
    """Run what `out` is missing (with nothing missing, neither Ray nor a model starts); the
    summary's wall time runs from `started` (a `time.perf_counter` value; default: now).
    Raises JobInputError (before Ray starts) if `out` holds another run, PlacementError if the
    cluster cannot hold the replicas."""
    started = time.perf_counter() if started is None else started
    claim_run_dir(out, cfg, problems)
    progress = Progress(cfg.n * len(problems), len(problems))

    def on_problem(state) -> None:
        progress.problems += 1
        state.result = problem_result(state, cfg)
        (out / "problems" / f"{state.problem.id}.json").write_text(json.dumps(state.result))
        if cfg.log_trajectories:
            write_log_line(state, out / "trajectory-log.jsonl")
        print(problem_line(state.result, state.problem), flush=True)

    states, retries = run_missing(
        cfg, problems, out / "trajectories.jsonl", job_id_for(out), progress, on_problem
    )
    progress.close()
    with (out / "results.jsonl").open("w") as f:
        for p in problems:
            f.write(json.dumps(states[p.id].result) + "\n")
    summary = summarize(states, cfg, progress, started)
    summary["retries"] = retries
    summary = with_sessions(summary, progress.tokens, out / "summary.json")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if line := plain_steps_line(summary, cfg):
        print(line, flush=True)
    if warning := truncation_warning(summary["truncated"], cfg.sampling.max_new_tokens):
        print(f"[job] warning: {warning}", flush=True)
    print(f"[job] done: {json.dumps(summary)}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    startup.settle()  # the imports are done (held from the module's first line as a program)
    try:
        run(*parse(argv), started=process_started())
    except (JobInputError, PlacementError) as e:
        print(f"jobs.best_of_n: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGTERM (JobStopped) or Ctrl-C
        return stopped("jobs.best_of_n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
