"""`jetllm gateway`: the OpenAI-compatible HTTP server (jetllm/gateway/)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator

from ..spawn import jetllm_command
from . import batches_cmd
from .common import add_nats, nats_url


def add_gateway_options(p: argparse.ArgumentParser, *, port_flag: str = "--port") -> None:
    g = p.add_argument_group("OpenAI-compatible gateway")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument(port_flag, type=int, default=8000, dest="http_port", help="HTTP port (default: 8000)")
    g.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="answer 429 (Retry-After) while a model has more than this many jobs no worker has taken "
        "(default: no limit)",
    )
    g.add_argument(
        "--retry-after", type=int, default=2, help="seconds a 429 or 503 asks clients to wait (default: 2)"
    )
    g.add_argument(
        "--accept-timeout",
        type=float,
        default=60.0,
        help="a job no worker takes within this many seconds is cancelled and answered 503 (default: 60)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 << 20,
        help="larger request bodies are refused with 413 (default: 16 MiB)",
    )


def gateway_config(args: argparse.Namespace, url: str):
    from ..gateway.service import BatchSettings, GatewayConfig

    batches = None
    if args.batches_api:
        batches = BatchSettings(
            window=args.window,
            most=args.most,
            refill=args.refill,
            shard=args.shard,
            batches=args.batches,
            ack_wait=args.ack_wait,
            max_file_bytes=args.max_file_bytes,
        )
    return GatewayConfig(
        batches=batches,
        nats_url=url,
        namespace=args.namespace,
        max_queue=args.max_queue,
        retry_after=args.retry_after,
        accept_timeout=args.accept_timeout,
        max_body_bytes=args.max_body_bytes,
    )


def serve(args: argparse.Namespace, url: str) -> int:
    try:
        import uvicorn

        from ..gateway import create_app
    except ImportError as exc:
        print(
            f"jetllm gateway: {exc.name} is not installed; install jetllm with the 'gateway' extra "
            "(pip install 'jetllm[gateway]')",
            file=sys.stderr,
        )
        return 1
    app = create_app(gateway_config(args, url))
    # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again under the handler it
    # found; a no-op one makes a requested stop exit 0, as a worker's does
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.http_port, log_level="warning", access_log=False)
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    return serve(args, nats_url(args))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve the OpenAI API over HTTP in front of the workers",
        description="An OpenAI-compatible HTTP server (/v1/models, /v1/chat/completions, "
        "/v1/completions, /health, /metrics): each request becomes a job for the workers. "
        "Stateless: run as many as you like.",
    )
    add_nats(p)
    add_gateway_options(p)
    g = p.add_argument_group("files and batches (/v1/files, /v1/batches; kept in NATS)")
    g.add_argument(
        "--batches-api",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve /v1/files and /v1/batches and run a batch runner in this gateway (default: on)",
    )
    batches_cmd.add_gateway_flags(g)
    p.set_defaults(func=cmd_gateway)


def add_up_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible gateway (started beside the worker)")
    g.add_argument(
        "--gateway",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start `jetllm gateway` too (default: on when the 'gateway' extra is installed)",
    )
    g.add_argument("--gateway-host", default="127.0.0.1", help="its address (default: 127.0.0.1)")
    g.add_argument("--gateway-port", type=int, default=8000, help="its HTTP port (default: 8000)")


def installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("starlette", "uvicorn"))


@contextlib.contextmanager
def gateway_process(url: str, args: argparse.Namespace) -> Iterator[str | None]:
    """`jetllm gateway` beside `jetllm up`'s worker, stopped with it; yields its base URL (None when
    it was not started). Credentials reach it the way they reach the worker: in the environment."""
    if not args.gateway:
        yield None
        return
    if not installed():
        print(
            "jetllm up: no gateway (install jetllm with the 'gateway' extra for the OpenAI API)",
            file=sys.stderr,
        )
        yield None
        return
    import subprocess

    cmd = jetllm_command(
        "gateway",
        url,
        "--namespace",
        args.namespace,
        "--host",
        args.gateway_host,
        "--port",
        str(args.gateway_port),
    )
    proc = subprocess.Popen(cmd)
    try:
        yield f"http://{args.gateway_host}:{args.gateway_port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
