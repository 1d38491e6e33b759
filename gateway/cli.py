"""The `gateway` command: serve, check a config, plan capacity, run the demo. The only place
that exits."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from gateway.config import Config, ConfigError, load_config
from gateway.version import gateway_version


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gateway", description="KV-cache-aware routing gateway for vLLM / SGLang replicas"
    )
    p.add_argument("--version", action="version", version=f"gateway {gateway_version()}")
    sub = p.add_subparsers(dest="command")

    def common(sp: argparse.ArgumentParser, config_required: bool = True) -> None:
        sp.add_argument("--config", "-c", required=config_required, help="path to routes.yaml")
        sp.add_argument("--host", help="override server.host")
        sp.add_argument("--port", type=int, help="override server.port")
        sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
        sp.add_argument("--log-format", choices=["text", "json"])
        sp.add_argument(
            "--workers",
            type=int,
            default=1,
            help="gateway processes (needs Redis-backed index and limits)",
        )

    common(p, config_required=False)
    common(sub.add_parser("serve", help="serve the gateway (the default command)"))
    check = sub.add_parser("check", help="validate a config and print it resolved")
    check.add_argument("--config", "-c", required=True)
    sub.add_parser(
        "plan",
        help="replicas, KV capacity and latency floors for a model on a GPU (add -h for options)",
        add_help=False,
    )
    sub.add_parser(
        "demo",
        help="simulated replicas, round robin vs prefix-aware (add -h for options)",
        add_help=False,
    )
    return p


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    given = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    return {k: v for k, v in given.items() if v is not None}


def _overridden(config: Config, overrides: dict[str, object]) -> Config:
    return config.model_copy(update={"server": config.server.model_copy(update=overrides)})


def scale_out_problems(config: Config, workers: int) -> list[str]:
    """What stops several gateway processes from sharing one picture of the fleet."""
    if workers <= 1:
        return []
    out = []
    if config.index.backend != "redis":
        out.append(
            "index.backend: must be redis with --workers > 1 (each process would learn its own prefix index)"
        )
    if (
        any(t.limits.rules() or t.limits.per_model for t in config.tenants)
        and config.ratelimit.backend != "redis"
    ):
        out.append(
            "ratelimit.backend: must be redis with --workers > 1 (each process would enforce its own limits)"
        )
    return out


def app_from_env() -> object:
    """uvicorn's factory for worker processes: the config path and overrides come from the environment."""
    from gateway.http.app import create_app
    from gateway.telemetry.logs import setup_logging

    path = os.environ["KVGATEWAY_CONFIG"]
    config = load_config(path)
    overrides = json.loads(os.environ.get("KVGATEWAY_OVERRIDES", "{}"))
    config = config.model_copy(update={"server": config.server.model_copy(update=overrides)})
    setup_logging(config.server.log_level, config.server.log_format)
    return create_app(config, config_path=path, own_process=True)


def server_options(config: Config) -> dict[str, Any]:
    """uvicorn's settings for `gateway serve` (the gateway's server protocol, its timeouts)."""
    from gateway.transport.protocol import GuardedHttpToolsProtocol

    return dict(
        host=config.server.host,
        port=config.server.port,
        loop="uvloop",
        http=GuardedHttpToolsProtocol,
        ws="none",  # an Upgrade: websocket request is plain HTTP here: its answer OpenAI-shaped
        lifespan="on",
        log_config=None,
        access_log=False,
        proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* rewrite per request
        timeout_graceful_shutdown=int(config.server.graceful_shutdown_s),
        timeout_keep_alive=config.server.keep_alive_s,
        # no limit_concurrency: the app holds server.max_connections itself, so health probes
        # stay exempt and the 503 is OpenAI-shaped (GatewayApp)
    )


def serve(
    config: Config,
    config_path: str | None = None,
    workers: int = 1,
    overrides: dict[str, object] | None = None,
) -> None:
    import uvicorn

    from gateway.http.app import create_app
    from gateway.telemetry.logs import setup_logging

    setup_logging(config.server.log_level, config.server.log_format)
    common = server_options(config)
    if workers > 1:
        assert config_path is not None
        os.environ["KVGATEWAY_CONFIG"] = config_path
        os.environ["KVGATEWAY_OVERRIDES"] = json.dumps(overrides or {})
        uvicorn.run("gateway.cli:app_from_env", factory=True, workers=workers, **common)
        return
    app = create_app(config, config_path=config_path, own_process=True)
    uvicorn.Server(uvicorn.Config(app, **common)).run()


DEMO_NEEDS = ("simulator", "aiohttp")  # the simulator package and the demo's load client


def _demo(argv: Sequence[str]) -> int:
    try:
        from gateway import demo
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in DEMO_NEEDS:
            raise
        print(
            f"gateway demo: needs the simulator package and aiohttp, and {missing} is not "
            "installed (pip install 'kvgateway[demo]')",
            file=sys.stderr,
        )
        return 2
    return demo.main(argv)


PLAN_MODULE = "simulator.plan"  # the simulator's performance model, imported only by `gateway plan`


def _plan(argv: Sequence[str]) -> int:
    import importlib

    try:
        plan = importlib.import_module(PLAN_MODULE)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "simulator":
            raise
        print("gateway plan: needs the simulator package (pip install kvgateway)", file=sys.stderr)
        return 2
    return int(plan.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
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
    problems = scale_out_problems(config, args.workers)
    if problems:
        print(f"gateway: cannot run {args.workers} workers with {args.config}:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    overrides = _overrides(args)
    serve(_overridden(config, overrides), args.config, args.workers, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
