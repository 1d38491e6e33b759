"""The `gateway` command: serve, check a config, run the demo. The only place that exits."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .config import Config, ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gateway", description="KV-cache-aware routing gateway for vLLM / SGLang replicas"
    )
    sub = p.add_subparsers(dest="command")

    def common(sp: argparse.ArgumentParser, config_required: bool = True) -> None:
        sp.add_argument("--config", "-c", required=config_required, help="path to routes.yaml")
        sp.add_argument("--host", help="override server.host")
        sp.add_argument("--port", type=int, help="override server.port")
        sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
        sp.add_argument("--log-format", choices=["text", "json"])

    common(p, config_required=False)
    common(sub.add_parser("serve", help="serve the gateway (the default command)"))
    check = sub.add_parser("check", help="validate a config and print it resolved")
    check.add_argument("--config", "-c", required=True)
    sub.add_parser(
        "demo",
        help="simulated replicas, round robin vs prefix-aware (add -h for options)",
        add_help=False,
    )
    return p


def _overridden(config: Config, args: argparse.Namespace) -> Config:
    server = config.server.model_copy(
        update={
            k: v
            for k, v in {
                "host": args.host,
                "port": args.port,
                "log_level": args.log_level,
                "log_format": args.log_format,
            }.items()
            if v is not None
        }
    )
    return config.model_copy(update={"server": server})


def serve(config: Config, config_path: str | None = None) -> None:
    import uvicorn

    from .app import create_app
    from .logs import setup_logging

    setup_logging(config.server.log_level, config.server.log_format)
    app = create_app(config, config_path=config_path)
    uv = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(config.server.graceful_shutdown_s),
        limit_concurrency=None,
        h11_max_incomplete_event_size=64 * 1024,
    )
    uvicorn.Server(uv).run()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = _parser().parse_args(argv)
    command = args.command or "serve"
    if command == "serve" and not args.config:
        print("gateway: --config is required (try deploy/routes.example.yaml)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"gateway: invalid configuration in {args.config}:", file=sys.stderr)
        for line in exc.problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    if command == "check":
        print(json.dumps(config.redacted(), indent=2))
        print(f"gateway: {args.config} is valid", file=sys.stderr)
        return 0
    serve(_overridden(config, args), args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
