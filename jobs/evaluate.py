"""Accuracy and speed on AIME-2024, GPQA-Diamond and LiveCodeBench, as a Ray Job entrypoint (or
a plain local run), or of any OpenAI-compatible server.

    python -m jobs.evaluate --tasks aime24,gpqa_diamond,lcb --n 16 --method plain,stand \\
        --out results/eval [--round-items K] [--data hub|fixtures | --data-files F ...] \\
        [--release release_v5] [--limit K] [--log-samples] [--config configs/best_of_16.yaml] \\
        [--set key=value ...] [--test-timeout 6] \\
        [--endpoint http://host:port/v1 [--api-key K] [--concurrent 4]]

`--tasks` takes one or more names, comma-separated, as we, lm-eval (`gpqa_diamond_zeroshot`) or
lighteval (`lighteval|aime24|0|0`, `gpqa:diamond`) spell them.
`--method` is one or more names in `tts_service.drafters.registry.METHODS` (default auto);
`auto` runs, and names the run after, the method it resolves to on the model's device (on a
CPU it keeps the name `auto`: there it also draws children, `AUTO_FIELDS`). Several
methods run interleaved, in rounds of `--round-items` items (default: all) whose method order
alternates, so that their speeds are measured under the same conditions: the report divides
tokens/s only between runs of one invocation. With `--endpoint`,
the trajectories come from that server's chat completions (`n` choices per item) instead of
this service's actors, and the run is named `endpoint`.

Four steps: parse; validate the config, the method and the datasets (anything wrong exits 2
with one line on stderr, before any actor starts); run every item's N trajectories; write
`<out>/<task>/<method>/items.jsonl`, one graded row per item as it finishes (and, with
`--log-samples`, `samples.jsonl`: prompt, full text, extracted answer and verdict per
trajectory), then the report over every run in `<out>` (`tts_service/tasks/report.py`). Each
invocation adds its time, host, load average and speed to the run's `run.json`. A re-run skips
graded items and resumes half-done ones from `trajectories.jsonl` in the same directory.
"""

from __future__ import annotations

from tts_service import startup

if __name__ == "__main__":  # a process starting here: no collector passes over its imports
    startup.hold()

import argparse
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from actors.placement import PlacementError
from jobs.actor_set import JobActors, run_missing
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
    stopped,
    with_model,
)
from jobs.endpoint import Endpoint, EndpointError
from tts_service.drafters.registry import DEFAULT_METHOD, METHOD_NAMES, METHODS, resolve_method
from tts_service.schemas import JobConfig, Problem
from tts_service.tasks.items import TASK_ALIASES, TASK_NAMES, EvalItem, TaskName, task_name
from tts_service.tasks.loaders import DEFAULT_RELEASE, DatasetUnavailable, DataSource, load_rows
from tts_service.tasks.prompts import build_items
from tts_service.tasks.sandbox import Limits
from tts_service.timing import TIMING_KEYS, process_started, with_setup

if TYPE_CHECKING:
    from actors.pool import ResultsFile

ENDPOINT_METHOD = "endpoint"  # the run name of `--endpoint` runs: the server's method is its own


@dataclass(frozen=True)
class EvalJob:
    """One task, everything validated: the run writes into `out / task / method`."""

    cfg: JobConfig
    task: TaskName
    method: str
    items: list[EvalItem]
    out: Path
    run_info: dict  # what run.json records; a resumed run must match it
    limits: Limits
    log_samples: bool = False
    endpoint: Endpoint | None = None
    concurrent: int = 4  # requests in flight at the endpoint
    round_items: int | None = None  # items per interleaving round (None: all in one)
    typed: str = ""  # the task's name as the user typed it (lm-eval's layout uses it)

    @property
    def run_dir(self) -> Path:
        return self.out / self.task / self.method


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise JobInputError(message)


def _tasks(value: str) -> dict[TaskName, str]:
    """Our name of each task -> the name as typed (lm-eval's layout uses it: `gpqa_diamond`
    stays `gpqa_diamond` there)."""
    spelled = [t.strip() for t in value.split(",") if t.strip()]
    names = [task_name(t) for t in spelled]
    bad = [t for t, name in zip(spelled, names, strict=True) if name is None]
    if bad or not names:
        known = ", ".join([*TASK_NAMES, *TASK_ALIASES, "lighteval|aime24|0|0"])
        raise argparse.ArgumentTypeError(f"unknown task {', '.join(bad) or value!r} ({known})")
    typed: dict[TaskName, str] = {}
    for name, text in zip(names, spelled, strict=True):
        typed.setdefault(name, text)  # type: ignore[arg-type]
    return typed


def _methods(value: str) -> list[str]:
    names = [m.strip() for m in value.split(",") if m.strip()]
    bad = [m for m in names if m not in METHOD_NAMES]
    if bad or not names:
        known = ", ".join(METHOD_NAMES)
        raise argparse.ArgumentTypeError(f"unknown method {', '.join(bad) or value!r} ({known})")
    return list(dict.fromkeys(names))


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(prog="jobs.evaluate", description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument(
        "--tasks", "--task", required=True, type=_tasks, help="comma-separated: aime24,gpqa,lcb"
    )
    ap.add_argument(
        "--method",
        type=_methods,
        default=[DEFAULT_METHOD],
        help=f"comma-separated (default: {DEFAULT_METHOD})",
    )
    ap.add_argument(
        "--round-items", type=int, help="items per interleaving round of several methods"
    )
    ap.add_argument("--n", type=int, help="trajectories per item (default: the preset's n)")
    ap.add_argument("--model", help=MODEL_HELP)
    ap.add_argument("--out", required=True, help="runs and the report go here (required)")
    ap.add_argument("--data", choices=["hub", "fixtures"], help="default hub")
    ap.add_argument("--data-files", nargs="+", type=Path, help="local copies, dataset fields")
    ap.add_argument("--release", help=f"LiveCodeBench release (default {DEFAULT_RELEASE})")
    ap.add_argument("--limit", type=int, help="only the first K items of each task")
    ap.add_argument(
        "--config",
        type=Path,
        default=JOB_PRESET,
        help="YAML preset (default: the repository's configs/best_of_16.yaml)",
    )
    ap.add_argument("--set", action="append", default=[], help="override: key.sub=value")
    ap.add_argument(
        "--test-timeout",
        type=float,
        default=6.0,
        help="seconds per code test (default: %(default)s)",
    )
    ap.add_argument(
        "--log-samples", action="store_true", help="write samples.jsonl (every trajectory)"
    )
    ap.add_argument("--endpoint", help="an OpenAI-compatible API base, http://host:port/v1")
    ap.add_argument("--api-key", help="bearer token for --endpoint")
    ap.add_argument("--concurrent", type=int, default=4, help="requests in flight (--endpoint)")
    return ap.parse_args(argv)


def _flags(args: argparse.Namespace):
    """--n and --model as changes to the preset (a --set still wins over them)."""

    def update(data: dict) -> dict:
        if args.n is not None:
            data["n"] = args.n
        return with_model(args.model)(data)

    return update


def _source(args: argparse.Namespace) -> DataSource:
    if args.data_files and args.data:
        raise JobInputError("--data-files: give either --data or --data-files")
    if args.data_files and len(args.tasks) > 1:
        raise JobInputError("--data-files: one task at a time")
    source: DataSource = "files" if args.data_files else args.data or "hub"
    if args.release is not None and (source != "hub" or "lcb" not in args.tasks):
        raise JobInputError("--release: only for the lcb task with --data hub")
    return source


def _endpoint(args: argparse.Namespace) -> Endpoint | None:
    if args.endpoint is None:
        if args.api_key is not None:
            raise JobInputError("--api-key: only with --endpoint")
        return None
    if not args.endpoint.startswith(("http://", "https://")):
        raise JobInputError(f"--endpoint: expected http(s)://host:port/v1, got {args.endpoint!r}")
    if len(args.method) > 1:
        raise JobInputError("--method: the endpoint's server decides the method; give one")
    if args.concurrent < 1:
        raise JobInputError(f"--concurrent: must be >= 1, got {args.concurrent}")
    return Endpoint(args.endpoint, args.api_key)


def _config(args: argparse.Namespace, method: str) -> tuple[JobConfig, str]:
    """The validated config of one method, and the method's name as run: `auto` is named by
    the method it resolves to, unless its device's own fields (`AUTO_FIELDS`: drawn children
    on a CPU) make it a different drafter, which keeps the name `auto`."""
    cfg = load_config(args.config, args.set, _flags(args), method)
    if cfg.early_stop:
        raise JobInputError("early_stop: evaluation needs all N trajectories (pass@k, maj@k)")
    resolved = resolve_method(method, cfg.model.device)
    if METHODS[resolved].kind != cfg.drafter.kind:
        raise JobInputError(f"drafter.kind: {cfg.drafter.kind!r} is not --method {resolved}'s")
    if method == "auto":
        plain_method = load_config(args.config, args.set, _flags(args), resolved)
        if plain_method.drafter != cfg.drafter:
            return cfg, method
    return cfg, resolved


def parse(argv: list[str] | None) -> list[EvalJob]:
    """Parse and validate everything, the datasets included: one job per task and method, in
    task order. Raises JobInputError."""
    args = _arguments(argv)
    configs: dict[str, JobConfig] = {}  # the method as run -> its config
    for name in args.method:
        cfg, method = _config(args, name)
        configs[method] = cfg
    _check_counts(args)
    source = _source(args)
    endpoint = _endpoint(args)
    if endpoint is None:
        check_run(next(iter(configs.values())))  # the methods share the model and the store
    release = args.release or DEFAULT_RELEASE
    model = None  # the endpoint's, when there is one
    if endpoint is not None:
        configs = {ENDPOINT_METHOD: next(iter(configs.values()))}
        model = _endpoint_model(endpoint)
    out = output_dir(args.out)
    jobs = []
    for task in args.tasks:
        first = next(iter(configs.values()))
        items = _items(task, source, args.data_files, release, first.sampling.seed)
        for method, cfg in configs.items():
            run_info = _run_info(args, task, method, cfg, source, release, endpoint, model)
            job = EvalJob(
                cfg,
                task,
                method,
                items[: args.limit],
                out,
                run_info,
                Limits(timeout_s=args.test_timeout),
                args.log_samples,
                endpoint,
                args.concurrent,
                args.round_items,
                args.tasks[task],
            )
            _check_resumable(job)
            jobs.append(job)
    return jobs


def _check_counts(args: argparse.Namespace) -> None:
    """--limit, --round-items and --test-timeout are positive when given."""
    if args.limit is not None and args.limit < 1:
        raise JobInputError(f"--limit: must be >= 1, got {args.limit}")
    if args.round_items is not None and args.round_items < 1:
        raise JobInputError(f"--round-items: must be >= 1, got {args.round_items}")
    if args.test_timeout <= 0:
        raise JobInputError(f"--test-timeout: must be > 0, got {args.test_timeout}")


def _endpoint_model(endpoint: Endpoint) -> str:
    """The model the endpoint serves (its answer checks the endpoint before any run)."""
    try:
        return endpoint.model()
    except EndpointError as e:
        raise JobInputError(f"--endpoint: {e}") from e


def _items(
    task: TaskName, source: DataSource, files: list[Path] | None, release: str, seed: int
) -> list[EvalItem]:
    """The task's items, its dataset loaded last in `parse`: the Hub may take a while to
    answer. A missing or malformed dataset is a JobInputError."""
    try:
        rows = load_rows(task, source, files, release)
        return build_items(task, rows, seed)
    except DatasetUnavailable as e:
        raise JobInputError(f"--data hub: {e}" if source == "hub" else str(e)) from e
    except ValueError as e:
        raise JobInputError(str(e)) from e


def _run_info(
    args: argparse.Namespace,
    task: TaskName,
    method: str,
    cfg: JobConfig,
    source: DataSource,
    release: str,
    endpoint: Endpoint | None,
    model: str | None,
) -> dict:
    """What run.json records of one task and method: what a resumed run must match."""
    return {
        "task": task,
        "method": method,
        "drafter": None if endpoint else cfg.drafter.model_dump(mode="json"),
        "model": model if endpoint else cfg.model.name,
        "endpoint": endpoint.url if endpoint else None,
        "n": cfg.n,
        "sampling": cfg.sampling.model_dump(mode="json"),
        "chat": cfg.chat,
        "data": source,
        "data_files": [str(p) for p in args.data_files or []],
        "release": release if source == "hub" and task == "lcb" else None,
    }


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


def _samples(item: EvalItem, records: list[dict], row: dict) -> list[dict]:
    """`--log-samples` lines: what was asked, what came back, and how it was graded."""
    by_index = {r["index"]: r for r in records}
    return [
        {
            "id": item.id,
            "task": item.task,
            "index": t["index"],
            "prompt": item.prompt,
            "text": by_index[t["index"]]["text"],
            "finish_reason": t["finish_reason"],
            "answer": t["answer"],
            "reference": item.answer,
            "correct": t["correct"],
            **({"tests": t["tests"]} if "tests" in t else {}),
        }
        for t in row["trajectories"]
    ]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def schedule(jobs: list[EvalJob]) -> list[tuple[EvalJob, list[EvalItem]]]:
    """The order of the work: per task, its items in rounds of `round_items`, every method
    running each round, the methods' order alternating from round to round (so that none is
    always measured first, with a warmer machine or a fuller store)."""
    order = []
    for task in dict.fromkeys(j.task for j in jobs):
        group = [j for j in jobs if j.task == task]
        items = group[0].items
        size = group[0].round_items or len(items)
        for r, start in enumerate(range(0, len(items), size)):
            order += [(j, items[start : start + size]) for j in group[:: -1 if r % 2 else 1]]
    return order


def run_one(
    job: EvalJob,
    items: list[EvalItem],
    invocation: str,
    since: float,
    actors: JobActors | None = None,
) -> None:
    """Run what is missing of `items` (some or all of the job's) on `actors` (the
    evaluation's, kept across its tasks; default: its own); record this invocation's
    conditions and speed as one session in run.json, its wall time from `since` (a
    `time.perf_counter` value) to now."""
    from actors.pool import ResultsFile

    info = _open_run(job)
    graded = ResultsFile(job.run_dir / "items.jsonl", key="id", key_type=str)
    done = {row["id"] for row in graded.load()}
    todo = {item.id: item for item in items if item.id not in done}
    print(
        f"[eval] {job.task}/{job.method}: {len(items)} items, {len(items) - len(todo)} "
        f"already graded, {len(todo)} to run, n={job.cfg.n}",
        flush=True,
    )
    session = {
        "invocation": invocation,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "loadavg_start": _load(),
    }
    progress = Progress(job.cfg.n * len(todo), len(todo))
    on_problem = _grader(job, todo, graded, progress)
    if todo and job.endpoint is not None:
        _run_endpoint(job, list(todo.values()), progress, on_problem)
    elif todo:
        _run_actors(job, list(todo.values()), progress, on_problem, actors)
    progress.close()
    speed = with_setup(progress.summary(), since)
    session |= {k: speed[k] for k in ("new_tokens", *TIMING_KEYS)}
    session["loadavg_end"] = _load()
    info["sessions"].append(session)
    (job.run_dir / "run.json").write_text(json.dumps(info, indent=1), encoding="utf-8")


def _open_run(job: EvalJob) -> dict:
    """Write the run's run.json (its settings, the sandbox's protections on lcb, the earlier
    sessions kept) before anything runs, and return it for this session to be added."""
    from tts_service.tasks.sandbox import protections

    job.run_dir.mkdir(parents=True, exist_ok=True)
    run_file = job.run_dir / "run.json"
    before = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    info = dict(job.run_info, sandbox=protections() if job.task == "lcb" else None)
    info["lm_eval_task"] = job.typed or job.task
    info["sessions"] = before.get("sessions", [])
    run_file.write_text(json.dumps(info, indent=1), encoding="utf-8")
    if info["sandbox"]:
        print(f"[eval] sandbox: {json.dumps(info['sandbox'])}", flush=True)
    return info


def _grader(
    job: EvalJob, todo: dict[str, EvalItem], graded: ResultsFile, progress: Progress
) -> Callable[[str, list[dict]], None]:
    """`on_problem(item id, records)`: grade an item whose trajectories are all in, append its
    row to `graded` (and its samples with `--log-samples`) and print its verdict."""
    from tts_service.tasks.grading import grade_item

    def on_problem(item_id: str, records: list[dict]) -> None:
        progress.problems += 1
        item = todo[item_id]
        try:
            row = grade_item(item, records, job.limits)
        except Exception as e:  # noqa: BLE001 - one item never ends the evaluation
            why = f"{type(e).__name__}: {e}"
            print(
                f"[eval] item {item_id}: grader error ({why[:200]}); counted, going on", flush=True
            )
            try:
                row = grade_item(item, records, job.limits, failure=why)
            except Exception as again:  # noqa: BLE001 - records even the row cannot be built of
                why = f"{why}; then {type(again).__name__}: {again}"
                row = grade_item(item, [{"index": i} for i in range(len(records))], failure=why)
        graded.append(row)
        if job.log_samples:
            with (job.run_dir / "samples.jsonl").open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(s) + "\n" for s in _samples(item, records, row))
        print(
            f"[eval] item {row['id']}: {sum(row['correct'])}/{len(row['correct'])} correct, "
            f"vote {'correct' if row['maj_correct'][str(job.cfg.n)] else 'wrong'}",
            flush=True,
        )

    return on_problem


def _run_actors(
    job: EvalJob, items: list[EvalItem], progress: Progress, on_problem, actors: JobActors | None
) -> None:
    """Every item's n trajectories from this service's actors (resuming from
    trajectories.jsonl); graded as each item's last one arrives."""
    problems = [
        Problem(id=i.id, question=i.prompt, task=i.answer_kind, answer=i.answer) for i in items
    ]
    run_missing(
        job.cfg,
        problems,
        job.run_dir / "trajectories.jsonl",
        job_id_for(job.run_dir),
        progress,
        lambda state: on_problem(state.problem.id, list(state.records.values())),
        actors,
    )


def _run_endpoint(job: EvalJob, items: list[EvalItem], progress: Progress, on_problem) -> None:
    """Every item's n choices from the endpoint, `concurrent` requests at a time; graded here
    as each answer arrives."""
    assert job.endpoint is not None
    model, sampling = job.run_info["model"], job.cfg.sampling
    progress.begin()
    with ThreadPoolExecutor(job.concurrent) as pool:
        futures = {
            pool.submit(job.endpoint.trajectories, model, i.prompt, job.cfg.n, sampling, i.id): i
            for i in items
        }
        for future in as_completed(futures):
            records = future.result()
            for rec in records:
                progress.trajectory(rec)
            on_problem(futures[future].id, records)


def run(jobs: list[EvalJob], started: float | None = None) -> list[Path]:
    """Run what is missing of every task, then write the report; returns the report's paths.

    Each session's wall time runs from the previous one's end, the first's from `started` (a
    `time.perf_counter` value; default: now), so that an invocation's sessions add up to all
    the time it took, its setup (model loads, Ray) included."""
    from tts_service.tasks import report

    invocation = uuid.uuid4().hex[:12]
    since = time.perf_counter() if started is None else started
    with JobActors() as actors:  # one model load for every task and method
        for job, items in schedule(jobs):
            run_one(job, items, invocation, since, actors)
            since = time.perf_counter()
    out = jobs[0].out
    paths = report.write(out)
    written = json.loads(paths[0].read_text()) if paths else {"runs": []}
    for r in written["runs"]:
        m, sp, acc = r["metrics"], r["speed"], r["metrics"]["acceptance_length"]
        rates = (sp["tokens_per_s"], sp["decode_tokens_per_s"])
        tps_text, decode_text = (f"{x:.1f}" if x else "-" for x in rates)
        acc_text = f"{acc['value']:.2f}" if acc else "-"
        print(
            f"[eval] {r['task']}/{r['method']}: items {m['items']} "
            f"pass@1 {m['pass@1']['value']:.3f} maj@{m['n']} {m['maj@n']['value']:.3f} "
            f"pass@{m['n']} {m['pass@n']['value']:.3f} "
            f"no answer {m['no_answer_rate']['value']:.3f} "
            f"truncated {m['truncation_rate']['value']:.3f} "
            f"tokens/s {tps_text} (decoding {decode_text}, wall {sp['wall_s']:.1f} s = setup "
            f"{sp['setup_s']:.1f} s + decode {sp['decode_s']:.1f} s) acceptance length {acc_text}",
            flush=True,
        )
    for warning in report.run_warnings(written):
        print(f"[eval] warning: {warning}", flush=True)
    print(f"[eval] report: {', '.join(str(p) for p in paths)}", flush=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    startup.settle()  # the imports are done (held from the module's first line as a program)
    try:
        run(parse(argv), started=process_started())
    except (JobInputError, PlacementError) as e:
        print(f"jobs.evaluate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGTERM (JobStopped) or Ctrl-C
        return stopped("jobs.evaluate")
    except EndpointError as e:
        print(f"jobs.evaluate: endpoint failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
