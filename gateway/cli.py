"""The `loramux` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from pathlib import Path
from typing import TypeAlias

from loramux.gateway.setting_checks import PORTS, ConfigError, StartError
from loramux.gateway.settings import Settings

log = logging.getLogger("loramux")


def _demo_model(args: argparse.Namespace) -> None:
    from loramux.engine.demo_model import build_demo_model

    out = build_demo_model(Path(args.dir), seed=args.seed)
    print(out)


def _demo_adapters(args: argparse.Namespace) -> None:
    from loramux.adapters.demo import build_demo_adapters

    for path in build_demo_adapters(
        Path(args.model_dir), Path(args.out_dir), args.count, seed=args.seed
    ):
        print(path)


def ensure_model(settings: Settings) -> Path:
    """The configured model folder; the demo model is built there on first start. A ConfigError
    when the data directory cannot be used or LORAMUX_MODEL names no model folder: found here,
    before serve starts an engine that would fail on it."""
    settings.create_data_dir()
    folder = settings.model_dir
    if settings.model is not None:
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"LORAMUX_MODEL={folder} is not a model folder: it has no config.json"
            )
    elif not (folder / "config.json").is_file():
        from loramux.engine.demo_model import build_demo_model

        log.info("building the demo model in %s", folder)
        build_demo_model(folder, seed=0)
    return folder


def _chat(args: argparse.Namespace) -> None:
    """Stream one chat reply from the engine, in-process."""
    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.detokenizer import IncrementalDetokenizer
    from loramux.engine.outputs import EngineRequest
    from loramux.engine.sampling import SamplingParams

    settings = Settings()
    engine = AsyncEngine.from_config(settings.engine.engine_config(ensure_model(settings)))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    request = EngineRequest("cli", params, messages=[{"role": "user", "content": args.message}])

    detokenizer = IncrementalDetokenizer(engine.engine.tokenizer)

    async def stream() -> None:
        async for delta in engine.generate(request):
            text = "".join(detokenizer.add(t) for t in delta.token_ids)
            sys.stdout.write(text + (detokenizer.flush() if delta.finished else ""))
            sys.stdout.flush()
            if delta.usage is not None:
                u = delta.usage
                sys.stdout.write(
                    f"\n[{delta.finish_reason}: {u.prompt_tokens} prompt + "
                    f"{u.completion_tokens} completion tokens]\n"
                )

    try:
        asyncio.run(stream())
    finally:
        engine.shutdown()


def _serve(args: argparse.Namespace) -> None:
    """The gateway with its private redis-server and its engine as supervised child processes
    (each only when no external one is configured); see gateway.serve."""
    from loramux.gateway.serve import Bind, claim_data_dir, serve_forever
    from loramux.gateway.serve_workers import default_workers

    if args.workers is not None and args.workers < 1:
        raise SystemExit("--workers must be at least 1")

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per call to the engine
    settings = Settings()
    data_dir = settings.create_data_dir()
    # Only a serve that starts a private redis-server or engine claims the data directory (their
    # sockets are at fixed paths in it): not its workers, which use their parent's, nor gateways
    # with external ones sharing a volume (docker compose --scale gateway=N).
    private = settings.server.redis_url is None or not settings.server.engine_urls
    with claim_data_dir(data_dir) if private else contextlib.nullcontext():
        model_dir = ensure_model(settings)
        host = args.host or settings.server.host
        port = settings.server.port if args.port is None else args.port
        workers = args.workers or default_workers()
        control = Path(args.control_socket) if args.control_socket else None
        bind = Bind(host, port, workers, args.listen_fd, control)
        asyncio.run(serve_forever(settings, model_dir, bind))


def _engine(args: argparse.Namespace) -> None:
    """The engine in a process of its own, for gateways on this host or others."""
    from loramux.engine.service import Listen, run_engine_service

    settings = Settings()
    run_engine_service(
        settings.engine.engine_config(ensure_model(settings)),
        settings.model_name,
        Listen(
            args.address,
            args.health_host,
            args.health_port,
            settings.server.metrics_token,
            settings.server.max_header_kb,
        ),
        adapter_dir=settings.data_dir / "engine-adapters",
        token=settings.server.engine_token,
        log_level=args.log_level,
    )


def _ray_serve(args: argparse.Namespace) -> None:
    """loramux as a Ray Serve application (gateway.ray_app) on an existing Ray cluster."""
    from loramux.gateway.ray_app import run_forever

    options = {
        "gateway_replicas": args.gateway_replicas,
        "engine_replicas": args.engine_replicas,
        "engine_gpus": str(args.engine_gpus),
        "engine_cpus": str(args.engine_cpus),
    }
    run_forever(args.address, args.host, args.port, options)


def _admin_token(args: argparse.Namespace) -> None:
    from loramux.gateway.state import admin_auth

    auth = admin_auth(Settings())
    if auth.algorithm != "HS256":
        sys.exit(
            "loramux admin-token: admin tokens are RS256 (LORAMUX_ADMIN_PUBLIC_KEY is set): "
            "mint them where the private key is"
        )
    if not 1 <= args.ttl <= auth.max_ttl:
        sys.exit(
            f"loramux admin-token: --ttl must be 1 to {auth.max_ttl} seconds "
            "(LORAMUX_ADMIN_TOKEN_MAX_TTL)"
        )
    print(auth.mint(args.subject, ttl_seconds=args.ttl))


def _migrate(args: argparse.Namespace) -> None:
    from loramux.gateway.db.migrate import upgrade
    from loramux.gateway.db.session import url_for_logs

    settings = Settings()
    upgrade(settings.database_url)
    log.info("database at %s is up to date", url_for_logs(settings.database_url))


Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What `add_subparsers` returns: each `_add_<command>` adds one command to it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loramux", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_demo_model,
        _add_demo_adapters,
        _add_serve,
        _add_engine,
        _add_ray_serve,
        _add_admin_token,
        _add_migrate,
        _add_chat,
    ):
        add(sub)
    return parser


def _add_demo_model(sub: Subcommands) -> None:
    p = sub.add_parser("demo-model", help="write the small demo Llama checkpoint into DIR")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo_model)


def _add_demo_adapters(sub: Subcommands) -> None:
    p = sub.add_parser("demo-adapters", help="make N PEFT LoRA adapters for MODEL_DIR in OUT_DIR")
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_demo_adapters)


def _add_serve(sub: Subcommands) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway, with a private redis-server and an engine process unless "
        "LORAMUX_REDIS_URL and LORAMUX_ENGINE_URLS name external ones",
    )
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=_port, default=None, help="1 to 65535 (default: LORAMUX_PORT)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes sharing the port, the engine and Redis "
        "(default: one per two cores, at most 8)",
    )
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--control-socket", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_serve)


def _port(text: str) -> int:
    """--port's value, refused by argparse before anything starts when it is no port."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not PORTS.admits(port):
        raise argparse.ArgumentTypeError(f"must be an integer within 1..65535, not {text!r}")
    return port


def _add_engine(sub: Subcommands) -> None:
    p = sub.add_parser(
        "engine", help="run the engine, serving gateways over a ZeroMQ channel (ipc:// or tcp://)"
    )
    p.add_argument(
        "--address",
        default="tcp://127.0.0.1:8100",
        help="where gateways connect: tcp://HOST:PORT or ipc:///PATH (LORAMUX_ENGINE_URLS names it)",
    )
    p.add_argument("--health-host", default="127.0.0.1")
    p.add_argument("--health-port", type=int, default=8101, help="HTTP /health and /metrics")
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error", "critical")
    )
    p.set_defaults(func=_engine)


def _add_ray_serve(sub: Subcommands) -> None:
    p = sub.add_parser(
        "ray-serve",
        help="deploy gateways and engines as a Ray Serve application (needs the `ray` extra "
        "and LORAMUX_REDIS_URL); docs/architecture.md, Processes",
    )
    p.add_argument("--address", default="auto", help="the Ray cluster (default: the running one)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gateway-replicas", default="2", help="a count, or auto")
    p.add_argument("--engine-replicas", default="auto", help="a count, or auto (autoscaled)")
    p.add_argument("--engine-gpus", type=float, default=1.0, help="GPUs per engine replica")
    p.add_argument("--engine-cpus", type=float, default=1.0, help="CPUs per engine replica")
    p.set_defaults(func=_ray_serve)


def _add_admin_token(sub: Subcommands) -> None:
    p = sub.add_parser(
        "admin-token", help="print a fresh admin JWT signed with the configured secret"
    )
    p.add_argument("--subject", default="admin")
    p.add_argument(
        "--ttl",
        type=int,
        default=3600,
        help="seconds until it expires (at most LORAMUX_ADMIN_TOKEN_MAX_TTL)",
    )
    p.set_defaults(func=_admin_token)


def _add_migrate(sub: Subcommands) -> None:
    p = sub.add_parser("migrate", help="bring the database to the current schema")
    p.set_defaults(func=_migrate)


def _add_chat(sub: Subcommands) -> None:
    p = sub.add_parser("chat", help="stream one chat reply from the in-process engine")
    p.add_argument("message", nargs="?", default="Write a Python function that reverses a list.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_chat)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except StartError as exc:  # the operator's to fix: one line, no traceback
        sys.exit(f"loramux {args.command}: {exc}")


if __name__ == "__main__":
    main()
