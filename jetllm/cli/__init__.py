"""The `jetllm` command. Producer commands never import vLLM; worker commands import it lazily."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from .. import __version__
from ..bench import batch as bench_batch
from ..bench import chaos as bench_chaos
from ..bench import cluster as bench_cluster
from ..bench import kvtransfer as bench_kv
from ..bench import routersim as bench_router_sim
from ..bench import routing as bench_routing
from ..bench import run as bench
from ..errors import JetllmError
from . import (
    batches_cmd,
    demo,
    dlq,
    fleet,
    gateway_cmd,
    kvevents,
    lora_cmd,
    natsconfig_cmd,
    produce,
    reference_cmd,
    router_cmd,
    tinymodel_cmd,
    worker_cmd,
)
from .common import export_nats_flags, setup_logging


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jetllm",
        description="LLM inference jobs on NATS JetStream, served by vLLM workers.",
    )
    p.add_argument("--version", action="version", version=f"jetllm {__version__}")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.register(sub)
    worker_cmd.register(sub)
    produce.register(sub)
    batches_cmd.register(sub)
    gateway_cmd.register(sub)
    dlq.register(sub)
    fleet.register(sub)
    lora_cmd.register(sub)
    kvevents.register(sub)
    router_cmd.register(sub)
    reference_cmd.register(sub)
    natsconfig_cmd.register(sub)
    tinymodel_cmd.register(sub)
    bench.register(sub)
    bench_chaos.register(sub)
    bench_kv.register(sub)
    bench_cluster.register(sub)
    bench_batch.register(sub)
    bench_router_sim.register(sub)
    bench_routing.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.log_level)
    export_nats_flags(args)
    try:
        code = int(args.func(args) or 0)
    except Exception as exc:
        cause = _leaf(exc)
        if not isinstance(cause, (JetllmError, ConnectionError)):
            raise
        print(f"jetllm {args.command}: {cause}", file=sys.stderr)  # a refusal, bad credentials: one line
        return 1
    if getattr(args, "engine_process", False):
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """A process that held a vLLM engine spends seconds in the interpreter's own teardown (some
    600,000 objects, torch's finalizers) and ends it with a TypeError from vLLM's AsyncLLM.__del__.
    By now the engine, the NATS connection and any server it started are closed and its logs are
    flushed here, so it leaves without that teardown: a SIGTERMed worker is gone seconds sooner."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


if __name__ == "__main__":
    sys.exit(main())
