"""`tts serve`: the OpenAI-compatible endpoint on Ray Serve, on the cluster at RAY_ADDRESS or a
private Ray bound to 127.0.0.1; the Serve config is validated before Ray starts.
"""

from __future__ import annotations

import argparse
import sys

from tts_service.cli.common import UsageError
from tts_service.config import load_yaml


def add_parser(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP endpoint on Ray Serve")
    srv.add_argument("--config", default="configs/serve.yaml", help="a Serve config file")
    srv.add_argument("--host", help="bind address (default from the config: 127.0.0.1)")
    srv.add_argument("--port", type=int)
    srv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Attach to RAY_ADDRESS or start a private loopback Ray, deploy the app, serve until
    interrupted."""
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
    import time

    from ray import serve

    from actors.cluster import connect
    from tts_service.serve.app import build_app

    print(f"tts: Ray: {connect()}", file=sys.stderr, flush=True)
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
