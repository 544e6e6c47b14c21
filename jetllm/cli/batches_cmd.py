"""Durable batches from the command line: `jetllm batch --detach/--follow/--download` and
`jetllm batch-runner`. They talk to NATS directly, as a gateway does; no HTTP in between."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from .. import taskdump
from ..aio import run, supervised, task_group
from ..batches import plan
from ..batches.runner import BatchRunner
from ..batches.service import DEFAULT_MAX_FILE_BYTES, ApiError, BatchService
from ..openai.endpoints import ENDPOINTS
from ..producer import Client
from ..schemas import TERMINAL_STATUSES, BatchState
from .common import add_nats, nats_url


@asynccontextmanager
async def _service(args: argparse.Namespace, name: str) -> AsyncIterator[tuple[Client, BatchService]]:
    async with Client(nats_url(args), namespace=args.namespace, name=name) as client:
        service = await BatchService.open(
            client.js,
            client.names,
            ack_wait=getattr(args, "ack_wait", None),  # only a runner's flag sets the consumer's
            max_file_bytes=getattr(args, "max_file_bytes", DEFAULT_MAX_FILE_BYTES),
        )
        yield client, service


def _endpoint(path: Path) -> str:
    """The url of the file's first request line: every line must name the same one."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if url in ENDPOINTS:
                    return str(url)
                break
    raise ApiError(
        f"{path}: the first line needs a url of {' or '.join(ENDPOINTS)} (OpenAI's batch input format: "
        "custom_id, method, url, body)",
        param="url",
    )


async def detach(args: argparse.Namespace, path: Path) -> int:
    endpoint = _endpoint(path)
    async with _service(args, "jetllm-batch") as (_, service):
        f = await service.upload(path.read_bytes(), path.name, "batch")
        state = await service.create(f.id, endpoint, args.completion_window)
    print(state.id)
    print(f"follow it with: jetllm batch --follow {state.id}", file=sys.stderr)
    return 0


def _bar(state: BatchState, started: float) -> str:
    c = state.request_counts
    done = c.completed + c.failed
    width = 30
    filled = int(width * done / c.total) if c.total else 0
    rate = done / max(time.monotonic() - started, 1e-9)
    return (
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{c.total} lines, {c.failed} failed, "
        f"{rate:.1f} lines/s, {state.status}"
    )


async def follow(args: argparse.Namespace, batch_id: str) -> int:
    """Until the batch ends; nothing is kept here, so following again after a crash goes on."""
    started = time.monotonic()
    show = not args.quiet and (sys.stderr.isatty() or args.progress)
    async with _service(args, "jetllm-batch") as (_, service):
        while True:
            state = await service.get(batch_id)
            if show:
                sys.stderr.write(_bar(state, started))
                sys.stderr.flush()
            if state.status in TERMINAL_STATUSES:
                break
            await anyio.sleep(1.0)
    if show:
        sys.stderr.write("\n")
    c = state.request_counts
    print(
        f"batch {batch_id}: {state.status}; {c.completed} completed, {c.failed} failed of {c.total}; "
        f"output {state.output_file_id or '-'}, errors {state.error_file_id or '-'}",
        file=sys.stderr,
    )
    for issue in state.errors:
        where = f" (line {issue.line})" if issue.line else ""
        print(f"  {issue.code}{where}: {issue.message}", file=sys.stderr)
    return 0 if state.status == "completed" else 1


async def download(args: argparse.Namespace, batch_id: str, out: Path) -> int:
    """The output file to OUT, the error file (if any) beside it as OUT.errors.jsonl."""
    async with _service(args, "jetllm-batch") as (_, service):
        state = await service.get(batch_id)
        if state.status not in TERMINAL_STATUSES:
            raise ApiError(f"batch {batch_id} is {state.status}; wait for it with --follow {batch_id}")
        out.write_bytes(await service.content(state.output_file_id) if state.output_file_id else b"")
        wrote = [str(out)]
        if state.error_file_id:
            errors = out.with_name(out.name + ".errors.jsonl")
            errors.write_bytes(await service.content(state.error_file_id))
            wrote.append(str(errors))
    print(f"wrote {', '.join(wrote)}", file=sys.stderr)
    return 0


async def _runner(args: argparse.Namespace) -> int:
    async with _service(args, "jetllm-batch-runner") as (client, service):
        runner = BatchRunner.configured(client, service, args)
        print(f"batch runner {runner.instance} on namespace {args.namespace}", file=sys.stderr, flush=True)
        with taskdump.dump_on_signal():
            async with task_group() as tg:

                async def on_signal() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:  # the batches held go back to the queue after ack_wait
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(on_signal)
                await supervised("batch runner", runner.serve)
    return 0


def cmd_runner(args: argparse.Namespace) -> int:
    taskdump.ignore_until_ready()
    return run(_runner, args)


def add_runner_flags(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--batch-window",
        dest="window",
        type=int,
        default=plan.DEFAULT_WINDOW,
        help="jobs of one batch waiting in the queue at once (running ones do not count): online requests "
        "wait behind at most this many (and --batch-refill's replacements), the batch takes every free "
        f"slot (default: {plan.DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--batch-max-lines",
        dest="most",
        type=int,
        default=plan.MAX_IN_FLIGHT,
        help="jobs of one batch queued or running at once: fewer than the fleet's slots leaves the rest to "
        f"online traffic (default: {plan.MAX_IN_FLIGHT})",
    )
    p.add_argument(
        "--batch-refill",
        dest="refill",
        type=float,
        default=plan.REFILL_SECONDS,
        help="seconds during which a line that ended may have its replacement queued beyond the window, "
        "so slots left free together are refilled at once; 0: the window alone bounds the queue "
        f"(default: {plan.REFILL_SECONDS:g})",
    )
    p.add_argument(
        "--batch-shard-lines",
        dest="shard",
        type=int,
        default=plan.SHARD_LINES,
        help="lines of one model sent together as one shard job, to models whose workers take shards (the "
        "registry says so): one message and one ack for all of them instead of a job each; 1: every line "
        f"a job of its own (default: {plan.SHARD_LINES})",
    )
    p.add_argument("--batches", type=int, default=2, help="batches one runner runs at once (default: 2)")
    p.add_argument(
        "--batch-ack-wait",
        dest="ack_wait",
        type=float,
        default=None,
        help="seconds after which a batch whose runner went silent goes to another runner: set on the "
        "runners' shared consumer, so the last runner given it decides for all (default: as the consumer "
        f"has it, {plan.DEFAULT_ACK_WAIT:.0f} in a new namespace; without the flag nothing existing is "
        "changed)",
    )


def add_gateway_flags(p: argparse._ActionsContainer) -> None:
    """What a gateway adds for its files and batches endpoints and the runner inside it."""
    add_runner_flags(p)
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES,
        help=f"largest file upload; more is a 413 (default: {DEFAULT_MAX_FILE_BYTES >> 20} MiB)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch-runner",
        help="run OpenAI-style batches on the fleet",
        description="Take batches created through /v1/batches (or `jetllm batch --detach`) and run their "
        "lines as jobs, a bounded number at a time. Run any number; a batch whose runner dies moves to another.",
    )
    add_nats(p)
    add_runner_flags(p)
    p.set_defaults(func=cmd_runner)
