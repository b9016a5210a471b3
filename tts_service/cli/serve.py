"""`tts serve`: the OpenAI-compatible endpoint on Ray Serve, on the cluster at RAY_ADDRESS or a
private Ray bound to 127.0.0.1; the Serve config is validated, and its store checked, before Ray
starts. vLLM's flags for the common cases override the config file; SIGTERM or Ctrl-C stops
the application.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading

from pydantic import ValidationError

from tts_service.cli.common import (
    DEFAULT_PRESET,
    UsageError,
    add_field,
    check_tensor_parallel,
    field_error,
    typed_flag,
    with_default,
)
from tts_service.config import ModelConfig, load_yaml
from tts_service.schemas import ServeConfig
from tts_service.timing import phase

SERVE_PRESET = DEFAULT_PRESET.with_name("serve.yaml")


DTYPES = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings of ours


def add_arguments(srv: argparse.ArgumentParser) -> None:
    srv.description = (
        "The OpenAI-compatible HTTP endpoint on Ray Serve, with `vllm serve`'s flags for what "
        "it shares. Flags override the config file; the defaults shown are configs/serve.yaml's."
    )
    preset = load_yaml(SERVE_PRESET)
    args = (preset.get("applications") or [{}])[0].get("args", {})
    http = preset.get("http_options", {})
    model_args = args.get("model", {})
    srv.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it"
    )
    srv.add_argument(
        "--config", default=str(SERVE_PRESET), help="a Serve config file (configs/serve.yaml)"
    )
    model = srv.add_argument_group("model")
    add_field(model, ServeConfig, "model.name", model_args, flag="--model")
    add_field(model, ServeConfig, "served_model_name", args)
    add_field(model, ServeConfig, "model.max_model_len", model_args)
    dtypes = [*ModelConfig.model_fields["dtype"].annotation.__args__, *DTYPES]
    add_field(model, ServeConfig, "model.dtype", model_args, choices=dtypes)
    add_field(model, ServeConfig, "chat_template", args)
    add_field(model, ServeConfig, "seed", args, type=int)
    add_field(model, ServeConfig, "generation_config", args)
    server = srv.add_argument_group("server")
    add_field(server, ServeConfig, "host", http)
    add_field(server, ServeConfig, "port", http)
    server.add_argument(
        "--api-key",
        help=with_default(ServeConfig.model_fields["api_key"].description, None)
        + " (or $TTS_API_KEY, which keeps it out of the process list)",
    )
    add_field(server, ServeConfig, "allow_unauthenticated", args, action="store_true", default=None)
    add_field(server, ServeConfig, "reject_unknown_fields", args, action="store_true", default=None)
    add_field(server, ServeConfig, "log_level", args, choices=["debug", "info", "warning", "error"])
    server.add_argument(
        "--verbose", action="store_true", help="Ray's and Serve's info lines (--log-level info)"
    )
    engine = srv.add_argument_group("engine")
    add_field(engine, ServeConfig, "max_rows", args, flag="--max-num-seqs", type=int)
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="vLLM's; not taken here: the KV cache is not preallocated but grows with the rows "
        "that decode (bound it with --max-num-seqs and --max-model-len)",
    )
    add_field(engine, ServeConfig, "tensor_parallel", args, aliases=("--tensor-parallel-size",))
    srv.set_defaults(func=run)


def serve_config(args: argparse.Namespace) -> tuple[dict, ServeConfig]:
    """(the config file, its application's ServeConfig with the flags over it); raises
    UsageError naming the bad field."""
    try:
        data = load_yaml(args.config)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config: {e}") from e
    app = (data.get("applications") or [{}])[0]
    raw = dict(app.get("args", {}))
    http = data.get("http_options", {})
    model = dict(raw.get("model", {}))
    flags = {
        "host": http.get("host") if args.host is None else args.host,
        "port": http.get("port") if args.port is None else args.port,
        "served_model_name": args.served_model_name,
        "tensor_parallel": args.tensor_parallel,
        "api_key": os.environ.get("TTS_API_KEY") if args.api_key is None else args.api_key,
        "max_rows": args.max_num_seqs,
        "seed": args.seed,
        "chat_template": args.chat_template,
        "reject_unknown_fields": args.reject_unknown_fields,
        "allow_unauthenticated": args.allow_unauthenticated,
        "generation_config": args.generation_config,
        "log_level": "info" if args.verbose and args.log_level is None else args.log_level,
    }
    raw.update({k: v for k, v in flags.items() if v is not None})
    if args.model_tag is not None and args.model not in (None, args.model_tag):
        raise UsageError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ: give one")
    name = args.model_tag or args.model
    model_flags = {
        "name": name,
        "max_model_len": args.max_model_len,
        "dtype": DTYPES.get(args.dtype, args.dtype),
    }
    model.update({k: v for k, v in model_flags.items() if v is not None})
    raw["model"] = model
    try:
        return data, ServeConfig.model_validate(raw)
    except ValidationError as e:
        raise UsageError(field_error(e)) from e


def run(args: argparse.Namespace) -> int:
    """Attach to RAY_ADDRESS or start a private loopback Ray, deploy the app, serve until
    SIGTERM or Ctrl-C, then stop the application (and the private Ray)."""
    if args.gpu_memory_utilization is not None:
        raise UsageError(
            "--gpu-memory-utilization: not taken: the KV cache grows with the rows that "
            "decode; bound it with --max-num-seqs and --max-model-len"
        )
    data, cfg = serve_config(args)
    flag = typed_flag(args, "--tensor-parallel", "--tensor-parallel-size")
    check_tensor_parallel(cfg, flag)
    app = (data.get("applications") or [{}])[0]
    from actors.cluster import cluster_address, connect

    private = cluster_address() is None
    check_before_ray(cfg, private)
    from ray import serve

    level = cfg.log_level.upper()
    logging.getLogger("ray.serve").setLevel(level)  # the driver's own Serve lines
    with phase("tts: starting Ray", "tts: Ray ready"):
        using = connect(logging_level=level)
    print(f"tts: Ray: {using}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    name = app.get("name", "tts")
    try:
        if cfg.tensor_parallel > 1:
            _check_placeable(cfg, flag, stop)
        with phase(f"tts: deploying {cfg.model.name} (its replicas load it)", "tts: deployed"):
            _deploy(cfg, name, app.get("route_prefix", "/"), stop)
        print(
            f"tts: serving {cfg.model.name} at http://{cfg.host}:{cfg.port}/v1 "
            "(SIGTERM or Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    except Stopped:
        pass
    except RuntimeError as e:  # Serve's: the application did not start
        print(f"tts: error: {replica_failure(name) or e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("tts: stopping", file=sys.stderr, flush=True)
        if private:  # the Serve instance and the Ray are this command's own
            _stop_private()
        else:  # a shared cluster: only this application
            serve.delete(name)
    return 0


def replica_failure(app: str) -> str | None:
    """Why application `app`'s replica did not start, in one line: the last exception line of
    its deployment's error in Serve's status (None if it has none)."""
    from ray import serve

    try:
        status = serve.status().applications.get(app)
    except Exception:  # noqa: BLE001 - a controller already gone: say what Serve raised
        return None
    for deployment in status.deployments.values() if status else ():
        lines = [line.strip() for line in (deployment.message or "").splitlines()]
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
        if errors:
            return f"a replica of {app} failed to start: {errors[-1]}"
    return None


def check_before_ray(cfg: ServeConfig, private: bool) -> None:
    """What the deployment needs, checked in a second or two before Ray starts (UsageError,
    exit 2): the model is there, the store answers, and on a private Ray the port is free (on a
    cluster, Serve may already listen there)."""
    from store.factory import check_store
    from store.redis_client import StoreUnavailableError
    from tts_service.model_check import ModelNotFoundError, check_model

    try:
        warning = check_model(cfg.model.name, here=private)
    except ModelNotFoundError as e:
        raise UsageError(f"--model: {e}") from e
    if warning:
        print(f"tts: warning: {warning}", file=sys.stderr, flush=True)
    try:
        check_store(cfg.store, cfg.store.url)
    except StoreUnavailableError as e:
        raise UsageError(f"--config: store.url: {e}") from e
    if private:
        with socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's proxy binds
            try:
                probe.bind((cfg.host, cfg.port))
            except OSError as e:
                raise UsageError(f"--port: {cfg.host}:{cfg.port} is taken ({e.strerror})") from e


SERVE_SHUTDOWN_S = 3.0
"""How long the private Serve may take to stop its replicas before its Ray is shut down."""
STOP_S = 7.0
"""How long stopping may take in all; then the command exits and its reaper stops what is left
(`actors.reaper`)."""


def _stop_private() -> None:
    """Stop Serve (its replicas flush their stores), then the private Ray, within `STOP_S`. A
    signal sent to the whole process group (`timeout`, `kill -TERM -PGID`, systemd) has also
    reached Ray's own processes: Serve's shutdown then waited 30 s for its controller and
    Ray's for its raylet, 31-41 s in all; here each wait is bounded."""
    import ray
    from ray import serve

    def stop() -> None:
        quiet = threading.Thread(target=serve.shutdown, name="tts-serve-shutdown", daemon=True)
        quiet.start()
        quiet.join(SERVE_SHUTDOWN_S)
        ray.shutdown()
        done.set()

    done = threading.Event()
    threading.Thread(target=stop, name="tts-stop", daemon=True).start()
    if not done.wait(STOP_S):
        print(
            f"tts: Ray did not stop within {STOP_S:g} s; its processes end with this one",
            file=sys.stderr,
            flush=True,
        )
        os._exit(0)


class Stopped(Exception):
    """SIGTERM or Ctrl-C arrived while the command waited for Ray."""


def _check_placeable(cfg: ServeConfig, flag: str, stop: threading.Event) -> None:
    """Refuse (exit 2) a tensor-parallel replica whose ranks the cluster cannot place on one
    node within `placement_timeout_s`, naming `flag` as typed and what the cluster has (Serve
    itself would wait for ever)."""
    from actors.placement import PlacementError, check_placeable
    from tts_service.serve.app import replica_bundles

    ranks = cfg.tensor_parallel
    with phase(f"tts: placing the {ranks} ranks of a replica on one node", "tts: placed"):
        try:
            if not check_placeable(replica_bundles(cfg), cfg.placement_timeout_s, stop.is_set):
                raise Stopped
        except PlacementError as e:
            raise UsageError(f"{flag} {ranks}: {e}") from e


def _deploy(cfg: ServeConfig, name: str, route_prefix: str, stop: threading.Event) -> None:
    """Deploy the application (its replicas load the model: minutes on a CPU) in a thread of
    its own, so that SIGTERM or Ctrl-C meanwhile stops the command within a second."""
    from ray import serve

    from tts_service.serve.app import build_app, serve_logging

    done, failed = threading.Event(), []

    def deploy() -> None:
        try:
            serve.start(
                http_options={"host": cfg.host, "port": cfg.port},
                logging_config=serve_logging(cfg.log_level),
            )
            serve.run(build_app(cfg), name=name, route_prefix=route_prefix)
        except BaseException as e:  # raised again in the command's thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=deploy, name="tts-deploy", daemon=True).start()
    while not done.wait(0.25):
        if stop.is_set():
            raise Stopped
    if failed:
        raise failed[0]
