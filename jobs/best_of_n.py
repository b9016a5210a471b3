"""Best-of-N over a problems file, as a Ray Job entrypoint (or a plain local run).

    python -m jobs.best_of_n --config configs/best_of_16.yaml --problems problems.jsonl \\
        --out results/ [--set sampling.temperature=0.7 --set n=8 ...]

Four steps only: parse, validate (a bad field exits 2 before any actor starts), run the pool,
write results. Writes `trajectories.jsonl` (every trajectory as it finishes; the resume point),
`problems/<id>.json` (answer, votes, correct, trajectories, stats), and at the end
`results.jsonl` and `summary.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import yaml
from pydantic import ValidationError

from tts_service.config import JobConfig, Problem, load_yaml


class JobInputError(ValueError):
    """Bad configuration or problems file: exit code 2, before any actor starts."""


def apply_overrides(data: dict, sets: list[str]) -> dict:
    """`key.sub=value` (YAML value) into a nested dict."""
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise JobInputError(f"--set: expected key=value, got {item!r}")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise JobInputError(f"--set: {key!r} goes through a non-mapping")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_problems(path: Path) -> list[Problem]:
    if not path.is_file():
        raise JobInputError(f"--problems: no such file: {path}")
    problems, seen = [], set()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobInputError(f"--problems: cannot read {path}: {e}") from e
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            problem = Problem.model_validate_json(line)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "line"
            raise JobInputError(f"--problems: {path}:{lineno}: {where}: {first['msg']}") from e
        if problem.id in seen:
            raise JobInputError(f"--problems: {path}:{lineno}: duplicate id {problem.id!r}")
        seen.add(problem.id)
        problems.append(problem)
    if not problems:
        raise JobInputError(f"--problems: {path} has no problems")
    return problems


def parse(argv: list[str] | None) -> tuple[JobConfig, list[Problem], Path]:
    ap = argparse.ArgumentParser(prog="jobs.best_of_n", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/best_of_16.yaml")
    ap.add_argument("--problems", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="override: key.sub=value")
    args = ap.parse_args(argv)
    try:
        data = apply_overrides(load_yaml(args.config), args.set)
        cfg = JobConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise JobInputError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from e
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise JobInputError(f"--config: {e}") from e
    return cfg, load_problems(Path(args.problems)), Path(args.out)


def summarize(states: dict, cfg: JobConfig, wall_s: float) -> dict:
    tokens = sum(r["stats"]["new_tokens"] for s in states.values() for r in s.records.values())
    forwards = sum(
        r["stats"]["target_forwards"] for s in states.values() for r in s.records.values()
    )
    graded = [s for s in states.values() if s.problem.answer is not None]
    correct = sum(1 for s in graded if s.result and s.result.get("correct"))
    return {
        "problems": len(states),
        "trajectories": sum(len(s.records) for s in states.values()),
        "accuracy": correct / len(graded) if graded else None,
        "graded": len(graded),
        "total_tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "mean_acceptance_length": tokens / forwards if forwards else 0.0,
        "wall_s": round(wall_s, 2),
        "method": cfg.drafter.kind,
        "n": cfg.n,
    }


def problem_result(state, cfg: JobConfig) -> dict:
    from tts_service.aggregate import is_correct, majority_vote

    answers = state.answers()
    vote = majority_vote(answers, state.problem.task)
    recs = [state.records[i] for i in sorted(state.records)]
    tokens = sum(r["stats"]["new_tokens"] for r in recs)
    forwards = sum(r["stats"]["target_forwards"] for r in recs)
    correct = None
    if state.problem.answer is not None and state.problem.task != "code":
        correct = is_correct(vote.answer, state.problem.answer, state.problem.task)
    return {
        "id": state.problem.id,
        "answer": vote.answer,
        "votes": vote.votes,
        "share": vote.share,
        "no_answer": vote.num_no_answer,
        "correct": correct,
        "stopped_early": state.stopped_early,
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
            "acceptance_length": tokens / forwards if forwards else 0.0,
        },
    }


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


@contextlib.contextmanager
def store_url(cfg: JobConfig):
    if cfg.store.url != "local-redis":
        yield cfg.store.url
        return
    from store.local_server import LocalRedisServer

    with LocalRedisServer() as server:
        print(f"[job] started redis-server at {server.url}", flush=True)
        yield server.url


def placed_actors(cfg: JobConfig) -> tuple[JobConfig, int, int, list | None]:
    """(config, replicas, GPUs per replica, scheduling strategies). Without GPUs: `replicas`
    CPU actors. With GPUs: the placement plan sizes each replica from the model's parameter
    count and reserves its GPUs as one STRICT_PACK group; a replica of several GPUs loads the
    model sharded over exactly those (device_map + max_memory)."""
    import ray
    import torch
    from transformers import AutoConfig

    from actors.placement import (
        count_params_from_config,
        create_placement_groups,
        plan_placement,
        scheduling_strategy,
    )
    from tts_service.models import model_source

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if not gpus or cfg.model.device == "cpu":
        return cfg, cfg.replicas or 1, 0, None
    dtype = torch.bfloat16 if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    dtype_bytes = torch.finfo(dtype).bits // 8
    params = count_params_from_config(AutoConfig.from_pretrained(model_source(cfg.model)))
    plan = plan_placement(params, dtype_bytes, int(cfg.gpu_memory_gb * 1024**3), gpus)
    replicas = min(cfg.replicas or plan.num_replicas, plan.num_replicas)
    plan = dataclasses.replace(plan, num_replicas=replicas)
    print(f"[job] placement: {plan.reason}", flush=True)
    groups = create_placement_groups(plan, cfg.cpus_per_replica)
    if plan.gpus_per_replica > 1:
        memory = {str(k): v for k, v in plan.max_memory.items()}
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_memory": memory})})
    return cfg, replicas, plan.gpus_per_replica, [scheduling_strategy(g) for g in groups]


def run(cfg: JobConfig, problems: list[Problem], out: Path) -> dict:
    import ray

    from actors.pool import ResultsFile, TrajectoryPool, start_actors

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()  # inside `ray job submit`: attach to the cluster
        else:
            ray.init(
                num_cpus=max(2, math.ceil(cfg.cpus_per_replica * (cfg.replicas or 1))),
                include_dashboard=False,
                object_store_memory=500 * 1024**2,
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "problems").mkdir(exist_ok=True)
    job_id = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
    start = time.perf_counter()
    done = {"trajectories": 0, "tokens": 0, "problems": 0}
    total = cfg.n * len(problems)

    def on_trajectory(rec: dict) -> None:
        done["trajectories"] += 1
        done["tokens"] += rec["stats"]["new_tokens"]
        rate = done["tokens"] / (time.perf_counter() - start)
        print(
            f"[job] trajectories {done['trajectories']}/{total} problems "
            f"{done['problems']}/{len(problems)} {rate:.1f} tok/s",
            flush=True,
        )

    def on_problem(state) -> None:
        done["problems"] += 1
        state.result = problem_result(state, cfg)
        (out / "problems" / f"{state.problem.id}.json").write_text(json.dumps(state.result))
        if cfg.log_trajectories:
            write_log_line(state, out / "trajectory-log.jsonl")
        print(
            f"[job] problem {state.problem.id}: answer {state.result['answer']!r} "
            f"share {state.result['share']:.2f} correct {state.result['correct']}",
            flush=True,
        )

    with store_url(cfg) as url:
        placed_cfg, replicas, gpus, strategies = placed_actors(cfg)
        actors = start_actors(placed_cfg, replicas, url, gpus, strategies)
        pool = TrajectoryPool(cfg, actors, job_id, ResultsFile(out / "trajectories.jsonl"))
        states = pool.run(problems, on_trajectory, on_problem)
    with (out / "results.jsonl").open("w") as f:
        for p in problems:
            f.write(json.dumps(states[p.id].result) + "\n")
    summary = summarize(states, cfg, time.perf_counter() - start)
    summary["retries"] = pool.retries
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[job] done: {json.dumps(summary)}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, problems, out = parse(argv)
    except JobInputError as e:
        print(f"jobs.best_of_n: error: {e}", file=sys.stderr)
        return 2
    run(cfg, problems, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
