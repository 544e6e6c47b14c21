"""`jetllm worker` (one worker against any NATS) and `jetllm up` (embedded NATS plus a worker)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path

from .. import taskdump
from ..subjects.connection import redact
from .common import add_nats, nats_url
from .disagg import block_dir, prefill_worker
from .gateway_cmd import add_up_options, gateway_process
from .worker_flags import add_worker_options, engine_options, given_flags, worker_config

log = logging.getLogger("jetllm")


def check_role(args: argparse.Namespace) -> str | None:
    """Why the worker must not start with these flags for its role (None: it may)."""
    from ..workers.roles import ROLES, FlagNotForRole, UnknownRole, check_flags

    try:
        check_flags(args.role, given_flags(args), ROLES)
    except (UnknownRole, FlagNotForRole) as exc:
        return str(exc)
    return None


def check_connection(url: str) -> str | None:
    """Why the credential and TLS settings cannot work (None: they may), before the engine loads."""
    from ..errors import JetllmError
    from ..subjects.connection import Security, servers_of

    try:
        Security.from_env().check(servers_of(url))
    except JetllmError as exc:
        return str(exc)
    return None


def _engine_env() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cmd_worker(args: argparse.Namespace) -> int:
    taskdump.ignore_until_ready()
    _engine_env()
    from ..aio import describe, run
    from ..workers.main import EXIT_STARTUP_FAILED, run_worker

    refused = check_role(args) or check_connection(nats_url(args))
    if refused is not None:
        print(f"jetllm worker: {refused}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    try:
        if args.headless:
            from ..workers.headless import run_headless

            return run_headless(engine_options(args))
        with block_dir(args.role, engine_options(args), worker_config(args)) as (opts, config):
            return run(lambda: run_worker(nats_url(args), opts, config, nats_wait=args.nats_wait))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # a worker that served ends inside serve(), with its own exit log
        log.error("worker failed to start: %s", describe(exc), exc_info=exc)
        return EXIT_STARTUP_FAILED


def cmd_up(args: argparse.Namespace) -> int:
    """Embedded NATS (unless --nats) plus one worker (or, with --disagg, a decode worker here and
    a prefill worker beside it), until Ctrl-C."""
    taskdump.ignore_until_ready()
    _engine_env()
    from ..aio import describe, run
    from ..cpus import engine_cores
    from ..natsserver import NatsServer
    from ..workers.main import EXIT_STARTUP_FAILED, run_worker

    if args.disagg:
        if args.role != "generate":
            print(
                "jetllm up: --disagg starts a prefill and a decode worker; leave --role out", file=sys.stderr
            )
            return EXIT_STARTUP_FAILED
        args.role = "decode"
    refused = check_role(args) or (check_connection(args.nats) if args.nats else None)
    if refused is not None:
        print(f"jetllm up: {refused}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    server = None
    url = args.nats
    if url is None:
        data_dir = Path(args.data_dir or Path(tempfile.gettempdir()) / "jetllm-up")
        server = NatsServer(data_dir, port=args.port, sync_always=args.sync_always).start()
        url = server.url
    try:
        opts = engine_options(args)
        shown = redact(url)  # a URL with a password in it is printed without
        with contextlib.ExitStack() as stack:
            http = stack.enter_context(gateway_process(url, args))
            print(
                f"jetllm up: NATS at {shown}  (namespace {args.namespace!r}, model {opts.name!r})\n"
                f'  try:  jetllm generate --nats {shown} --model {opts.name} "Hello"\n'
                f"        jetllm batch --nats {shown} --model {opts.name} prompts.jsonl -o results.jsonl\n"
                + (f"        OpenAI API at {http} (any api_key)\n" if http else "")
                + "  Ctrl-C stops the worker and the server.",
                file=sys.stderr,
                flush=True,
            )
            if args.disagg:
                # data-parallel ranks take their cores from vLLM's per-rank lists: not ours to split
                engines = 1 if args.data_parallel_size > 1 else 2
                here, beside = engine_cores(0, engines), engine_cores(1, engines)
                stack.enter_context(prefill_worker(url, args, beside))
                os.environ.update(here)
            opts, config = stack.enter_context(block_dir(args.role, opts, worker_config(args)))
            return run(lambda: run_worker(url, opts, config, nats_wait=args.nats_wait))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        log.error("up failed: %s", describe(exc), exc_info=exc)
        return EXIT_STARTUP_FAILED
    finally:
        if server is not None:
            server.stop()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="run one worker against a NATS server",
        description="Run one worker: pull one role's jobs (generate by default) for one model "
        "and serve them with vLLM.",
    )
    add_nats(p)
    add_worker_options(p)
    p.set_defaults(func=cmd_worker, engine_process=True)

    p = sub.add_parser(
        "up",
        help="start an embedded NATS server and a worker",
        description="Start nats-server with JetStream (unless --nats is given) and one worker.",
    )
    add_nats(p)
    p.add_argument("--data-dir", default=None, help="where the embedded server keeps its JetStream data")
    p.add_argument("--port", type=int, default=4222, help="port of the embedded server")
    p.add_argument(
        "--sync-always",
        action="store_true",
        help="embedded server fsyncs every write before acknowledging it: a crash (not only a "
        "restart) then loses nothing acknowledged, at a cost in throughput",
    )
    p.add_argument(
        "--disagg",
        action="store_true",
        help="a decode worker here and a prefill worker beside it (two engines): long prompts are "
        "prefilled by the prefill worker and their KV blocks come through NATS",
    )
    add_up_options(p)
    add_worker_options(p)
    p.set_defaults(func=cmd_up, engine_process=True)
