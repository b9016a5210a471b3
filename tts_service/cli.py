"""The `tts` command (also `python -m tts_service`).

Each subcommand parses flags over a YAML preset, validates everything with pydantic before
loading anything, and exits with code 2 and one line on stderr naming the bad field.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError

from tts_service.config import (
    DRAFTER_CONFIGS,
    CalibrateTreeRequest,
    GenerateRequest,
    ReplayRequest,
    SolveRequest,
    default_max_rows,
    load_yaml,
    read_problems,
)
from tts_service.drafters.methods import METHOD_NAMES, method_drafter

DEFAULT_PRESET = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _field_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"] if not str(x).isdigit()]
    name = loc[-1] if loc else "input"
    return f"--{name.replace('_', '-')}: {first['msg']}"


def _add_common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_PRESET), help="YAML preset (configs/)")
    p.add_argument("--model", help="alias (smollm2-135m), hub id or local path")
    p.add_argument("--method", help=f"one of {', '.join(METHOD_NAMES)}")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16, float64")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--num-nodes", type=int, help="draft tree size (recycle, stand, goose)")
    p.add_argument("--tree", help="tree shape name or JSON path (recycle, stand)")
    p.add_argument("--deterministic", action="store_true", help="stand: top-k, not Gumbel")
    p.add_argument(
        "--harvest-rejected",
        action="store_true",
        help="stand: also store distributions at rejected tree nodes",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _request(args: argparse.Namespace, model_cls: type[BaseModel], extra: dict) -> Any:
    """Merge the preset and the flags into a validated request (raises UsageError)."""
    try:
        preset = load_yaml(args.config)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config: {e}") from e
    method = args.method or preset.get("method", "pld")
    device = args.device or preset.get("model", {}).get("device", "auto")
    try:
        drafter = method_drafter(method, preset.get("drafters", {}), device)
    except ValueError as e:
        raise UsageError(f"--method: {e}") from e
    fields = DRAFTER_CONFIGS[drafter["kind"]].model_fields  # a flag applies where it is a field
    flags = {
        "num_nodes": args.num_nodes,
        "tree": args.tree,
        "stochastic": False if args.deterministic else None,
        "harvest_rejected": True if args.harvest_rejected else None,
    }
    drafter.update({k: v for k, v in flags.items() if v is not None and k in fields})
    model = dict(preset.get("model", {}))
    model.update({k: getattr(args, k) for k in ("device", "dtype") if getattr(args, k)})
    if args.model is not None:
        model["name"] = args.model
    sampling = dict(preset.get("sampling", {}))
    for key in ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = tuple(args.stop) if key == "stop" else getattr(args, key)
    raw = {"model": model, "drafter": drafter, "sampling": sampling, **extra}
    try:
        return model_cls.model_validate(raw)
    except ValidationError as e:
        raise UsageError(_field_error(e)) from e


def _load(req: GenerateRequest | SolveRequest | CalibrateTreeRequest):
    from tts_service.drafters.registry import needs_cost  # heavy: only after validation
    from tts_service.generation import Generator
    from tts_service.models import ModelNotFoundError

    try:
        calibrate = isinstance(req, GenerateRequest | SolveRequest) and needs_cost(req.drafter)
        return Generator.load(req.model, calibrate=calibrate)
    except ModelNotFoundError as e:
        raise UsageError(f"--model: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    req = _request(args, GenerateRequest, {"prompt": args.prompt, "chat": args.chat})
    gen = _load(req)
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


def _store_flags(args: argparse.Namespace) -> dict:
    """--store overrides TTS_STORE_URL (read here, at the edge); neither: in-process."""
    url = args.store or os.environ.get("TTS_STORE_URL") or None
    out: dict[str, Any] = {"url": url} if url else {}
    if getattr(args, "store_fallback", False):
        out["fallback"] = True
    return out


@contextlib.contextmanager
def _store_server(url: str | None):
    """Resolve 'local-redis' to a private redis-server that lives as long as the command."""
    if url != "local-redis":
        yield url
        return
    from store.local_server import LocalRedisServer, RedisServerError

    try:
        server = LocalRedisServer().start()
    except RedisServerError as e:
        raise UsageError(f"--store: {e}") from e
    try:
        print(f"tts: started redis-server at {server.url}", file=sys.stderr)
        yield server.url
    finally:
        server.stop()


def cmd_store(args: argparse.Namespace) -> int:
    url = args.store or os.environ.get("TTS_STORE_URL")
    if not url or not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError("--store: give a redis://host:port/db URL (or set TTS_STORE_URL)")
    if args.scope != "all" and args.id is None and args.scope != "global":
        raise UsageError(f"--id: the {args.scope} scope needs an id (or use --scope all)")
    import redis

    from store.redis_store import delete_scope, scope_stats

    prefix = "tts:" if args.scope == "all" else f"tts:{args.scope}:{args.id or 'default'}:"
    client = redis.Redis.from_url(url, socket_connect_timeout=2.0)
    try:
        if args.action == "stats":
            out = {
                **scope_stats(client, prefix),
                "used_memory": client.info("memory").get("used_memory_human"),
                "maxmemory_policy": client.config_get("maxmemory-policy").get("maxmemory-policy"),
            }
        else:
            out = {"prefix": prefix, "deleted": delete_scope(client, prefix)}
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise UsageError(f"--store: cannot reach Redis at {url}: {e}") from e
    print(json.dumps(out))
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    if (args.question is None) == (args.problems is None):
        raise UsageError("--problems: give one QUESTION or --problems FILE (not both)")
    req = _request(
        args,
        SolveRequest,
        {
            "question": args.question,
            "problems": args.problems,
            "task": args.task,
            "n": args.n,
            "chat": not args.no_chat,
            "max_rows": args.max_rows,
            "store": _store_flags(args),
        },
    )
    if req.problems is not None:
        try:
            questions = [(p.id, p.question) for p in read_problems(req.problems)]
        except ValueError as e:
            raise UsageError(f"--problems: {e}") from e
    else:
        questions = [(args.prompt_id, req.question)]
    gen = _load(req)
    from tqdm import tqdm

    from store.factory import open_global_store, open_problem_store, problem_id
    from store.redis_store import StoreUnavailableError
    from tts_service.generation import InputTooLongError
    from tts_service.runner import TrajectoryRunner
    from tts_service.solve import ProblemInput, solve_problems

    bar = tqdm(total=req.n * len(questions), desc="trajectories", file=sys.stderr, disable=None)

    def progress(_pid, t) -> None:
        bar.set_postfix(acc_len=f"{t.output.stats.acceptance_length:.2f}")
        bar.update(1)

    max_rows = req.max_rows or default_max_rows(str(gen.loaded.device))
    try:
        with _store_server(req.store.url) as url:
            try:
                global_store = open_global_store(req.store, url)
                problems = []
                for pid, question in questions:
                    ids = gen.encode(question, chat=req.chat)
                    store = open_problem_store(req.store, url, problem_id(ids), global_store)
                    problems.append(ProblemInput(pid, ids, store))
            except StoreUnavailableError as e:
                raise UsageError(f"--store: {e}") from e
            run = solve_problems(
                TrajectoryRunner(gen, max_rows),
                problems,
                req.n,
                req.drafter,
                req.sampling,
                on_trajectory=progress,
                record=args.log is not None,
            )
    except InputTooLongError as e:
        raise UsageError(f"question: {e}") from e
    finally:
        bar.close()
    if args.log is not None:
        from tts_service.replay import LogWriter

        writer = LogWriter(Path(args.log))
        for problem, result in zip(problems, run.problems, strict=True):
            writer.write(result.logged(problem.problem_id, problem.prompt_ids))
    out = run.to_dict(req.task)
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        for p in out["problems"]:
            for t in p["trajectories"]:
                print(f"--- {p['id']} trajectory {t['index']} ({t['finish_reason']}) ---")
                print(t["text"])
            print(f"=== {p['id']}: answer {p['answer']!r}, votes {p['votes']} ===")
        print(json.dumps(out["stats"]), file=sys.stderr)
    return 0


def cmd_calibrate_tree(args: argparse.Namespace) -> int:
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
        raise UsageError(_field_error(e)) from e
    from tts_service.calibrate import calibrate, calibrate_from_log

    if req.trajectories is not None:
        from tts_service.replay import LogFormatError, read_log

        try:
            problems, _ = read_log(req.trajectories, strict=True)
        except LogFormatError as e:
            raise UsageError(str(e)) from e
        tree = calibrate_from_log(req, problems)
    else:
        tree = calibrate(_load(req), req)
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


def cmd_replay(args: argparse.Namespace) -> int:
    raw = {
        "method": args.method,
        "trajectories": args.trajectories,
        "tree": args.tree,
        "nodes": args.nodes,
        "vocab_size": args.vocab_size,
        "strict": args.strict,
    }
    try:
        req = ReplayRequest.model_validate({k: v for k, v in raw.items() if v is not None})
    except ValidationError as e:
        raise UsageError(_field_error(e)) from e
    from tts_service.replay import LogFormatError, read_log, replay, replay_drafters

    try:
        problems, errors = read_log(req.trajectories, req.vocab_size, req.strict)
    except LogFormatError as e:
        raise UsageError(str(e)) from e
    for err in errors:
        print(f"tts replay: skipped {err}", file=sys.stderr)
    try:
        drafters = replay_drafters(req, problems)
    except ValidationError as e:
        raise UsageError(_field_error(e)) from e
    report = replay(problems, drafters)
    out = {
        "method": req.method,
        "problems": len(problems),
        "skipped_lines": len(errors),
        **report.to_dict(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0


def cmd_job(args: argparse.Namespace) -> int:
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


def cmd_serve(args: argparse.Namespace) -> int:
    """Start a local Ray if none is running, deploy the app, serve until interrupted."""
    try:
        data = load_yaml(args.config)
        app = (data.get("applications") or [{}])[0]
        from tts_service.config import ServeConfig

        cfg = ServeConfig.model_validate(app.get("args", {}))
    except (OSError, ValueError) as e:
        raise UsageError(f"--config: {e}") from e
    http = {
        **data.get("http_options", {}),
        **({"host": args.host} if args.host else {}),
        **({"port": args.port} if args.port else {}),
    }
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import time

    import ray
    from ray import serve

    from tts_service.serve.app import build_app

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(
        http_options={"host": http.get("host", "127.0.0.1"), "port": int(http.get("port", 8000))}
    )
    serve.run(
        build_app(cfg), name=app.get("name", "tts"), route_prefix=app.get("route_prefix", "/")
    )
    print(
        f"tts: serving {cfg.model.name} at http://{http.get('host', '127.0.0.1')}:"
        f"{http.get('port', 8000)}/v1 (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tts", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="one generation with a speculative method")
    gen.add_argument("prompt", help="the prompt text")
    _add_common_flags(gen)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.set_defaults(func=cmd_generate)
    sol = sub.add_parser("solve", help="best-of-N trajectories sharing one n-gram store")
    sol.add_argument("question", nargs="?", help="the problem text (or --problems FILE)")
    sol.add_argument("--problems", help="JSONL of problems (the jobs' format), all in one run")
    sol.add_argument("--task", default="math", help="how answers are voted: math, choice, code")
    _add_common_flags(sol)
    sol.add_argument("--n", type=int, default=16, help="trajectories (1..64)")
    sol.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    sol.add_argument("--log", help="append the trajectories to this JSONL trajectory log")
    sol.add_argument(
        "--max-rows",
        type=int,
        help="rows decoded together, refilled as they finish (default: 16 on CPU, 64 on GPU)",
    )
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
    sol.set_defaults(func=cmd_solve)
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
    cal.set_defaults(func=cmd_calibrate_tree)
    rep = sub.add_parser("replay", help="acceptance length of a drafter on a trajectory log")
    rep.add_argument("--method", required=True, help="pld, recycle or stand")
    rep.add_argument("--trajectories", required=True, help="JSONL trajectory log")
    rep.add_argument("--tree", help="tree shape name or JSON path (recycle, stand)")
    rep.add_argument("--nodes", type=int, help="draft tree size (pld: chain length)")
    rep.add_argument("--vocab-size", type=int, help="reject token ids >= this")
    rep.add_argument("--strict", action="store_true", help="reject the file at a bad line")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=cmd_replay)
    sto = sub.add_parser("store", help="look at or clean the Redis n-gram store")
    sto.add_argument("action", choices=["stats", "clear"])
    sto.add_argument("--scope", choices=["job", "problem", "global", "all"], default="all")
    sto.add_argument("--id", help="the scope's id (problem: the prompt hash in stats)")
    sto.add_argument("--store", help="redis://host:port/db (default: $TTS_STORE_URL)")
    sto.set_defaults(func=cmd_store)
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
    job.set_defaults(func=cmd_job)
    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP endpoint on Ray Serve")
    srv.add_argument("--config", default="configs/serve.yaml", help="a Serve config file")
    srv.add_argument("--host", help="bind address (default from the config: 127.0.0.1)")
    srv.add_argument("--port", type=int)
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"tts: error: {e}", file=sys.stderr)
        return 2
