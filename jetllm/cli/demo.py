"""`jetllm demo`: the whole path in one command — embedded NATS, a real vLLM worker, a batch.

With `--disagg` the worker is a decode worker beside a prefill worker (two engines, so it starts
more slowly): a long prompt is added to the batch, and the decode worker's count of where it
prefilled each prompt is printed at the end."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import anyio
import msgspec

from ..aio import run
from ..cpus import engine_cores
from ..schemas import BatchResult
from ..spawn import jetllm_command
from .common import TINY_MODEL_NAME

DISAGG_THRESHOLD = 64
"""Tokens from which the demo's decode worker hands a prompt to the prefill worker."""


async def _wait_ready(
    url: str, namespace: str, model: str, procs: list[subprocess.Popen], roles: set[str], timeout: float
) -> None:
    from ..producer.fleet import worker_statuses
    from ..subjects.connection import connect
    from ..subjects.names import Names

    nc = await connect(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited with code {proc.returncode} before it was ready")
            serving = {
                s.role
                for s in await worker_statuses(nc, Names(namespace), 0.3)
                if s.state == "serving" and s.model == model
            }
            if roles <= serving:
                return
            await anyio.sleep(0.3)
        raise TimeoutError(f"no {' and '.join(sorted(roles))} worker ready after {timeout:.0f}s")
    finally:
        await nc.close()


async def _prefill_counts(url: str, namespace: str) -> dict[str, int]:
    """Where the decode worker prefilled the batch's prompts, as it counts them."""
    from ..producer.fleet import worker_statuses
    from ..subjects.connection import connect
    from ..subjects.names import Names

    nc = await connect(url)
    try:
        for s in await worker_statuses(nc, Names(namespace), 2.0):
            if s.role == "decode":
                return {
                    k.removeprefix("prefill_"): int(v) for k, v in s.extra.items() if k.startswith("prefill_")
                }
        return {}
    finally:
        await nc.close()


def _with_a_long_prompt(prompts: Path, work: Path) -> Path:
    """The batch plus one prompt long enough to be worth a prefill worker."""
    line = {
        "id": "long-prompt",
        "prompt": "jobs travel through nats " * 40,
        "max_tokens": 16,
        "temperature": 0,
    }
    out = work / "prompts-disagg.jsonl"
    out.write_bytes(prompts.read_bytes().rstrip(b"\n") + b"\n" + msgspec.json.encode(line) + b"\n")
    return out


def _worker_cmd(url: str, model_dir: Path, *args: str) -> list[str]:
    return jetllm_command(
        "worker",
        url,
        "--model",
        str(model_dir),
        "--served-model-name",
        TINY_MODEL_NAME,
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(256 << 20),
        "--block-size",
        "32",
        *args,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from .. import tinymodel
    from ..batch import run_batch
    from ..natsserver import NatsServer

    prompts = (
        Path(args.prompts)
        if args.prompts
        else Path(str(resources.files("jetllm").joinpath("data", "prompts.jsonl")))
    )
    work = Path(tempfile.mkdtemp(prefix="jetllm-demo-"))
    print("1/4 building the tiny model (cached after the first run)", file=sys.stderr, flush=True)
    model_dir = tinymodel.ensure()
    if args.disagg:
        prompts = _with_a_long_prompt(prompts, work)
        workers = {
            "decode": ["--role", "decode", "--disagg-threshold", str(DISAGG_THRESHOLD)],
            "prefill": ["--role", "prefill"],
        }
    else:
        workers = {"generate": []}
    with NatsServer(work / "nats") as server:
        print(f"2/4 nats-server with JetStream at {server.url}", file=sys.stderr, flush=True)
        procs: list[subprocess.Popen] = []
        for i, (role, extra) in enumerate(workers.items()):
            log_path = work / f"{role}-worker.log" if args.disagg else work / "worker.log"
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        _worker_cmd(server.url, model_dir, *extra),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONUNBUFFERED": "1", **engine_cores(i, len(workers))},
                    )
                )
        try:
            what = "a prefill and a decode worker" if args.disagg else "a vLLM worker"
            print(f"3/4 starting {what} (logs in {work}) ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            run(_wait_ready, server.url, "default", TINY_MODEL_NAME, procs, set(workers), args.timeout)
            print(f"    ready in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
            out = work / "results.jsonl"
            print(f"4/4 jetllm batch {prompts.name} -> {out}", file=sys.stderr, flush=True)
            summary = run(
                lambda: run_batch(
                    server.url,
                    "default",
                    prompts,
                    out,
                    model=TINY_MODEL_NAME,
                    batch_id=f"demo-{int(time.time())}",
                    progress=sys.stderr.isatty(),
                )
            )
            for raw in out.read_bytes().splitlines():
                r = msgspec.json.decode(raw, type=BatchResult)
                if r.error:
                    print(f"  line {r.line} ({r.id}): error {r.error.code.value}: {r.error.message}")
                else:
                    shown = repr(r.text) if r.text is not None else str(r.token_ids)
                    tokens = r.usage.completion_tokens if r.usage else "?"
                    print(f"  line {r.line} ({r.id}): {r.finish_reason}, {tokens} tokens: {shown[:70]}")
            print(summary.describe(out), file=sys.stderr)
            if args.disagg:
                counts = run(_prefill_counts, server.url, "default")
                shown = ", ".join(f"{how.replace('_', ' ')} {n}" for how, n in sorted(counts.items()))
                print(
                    f"prefills on the decode worker: {shown or 'none counted'} (remote: by the prefill "
                    f"worker, its KV blocks through NATS; local: prompts under {DISAGG_THRESHOLD} tokens "
                    "or not worth a handoff)"
                )
            print("(the tiny model has random weights: its text is gibberish by design)", file=sys.stderr)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    code = proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
                print(f"worker stopped (exit code {code})", file=sys.stderr)
            print("server stopping", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="embedded NATS + a real vLLM worker + a batch of example prompts",
        description="Start nats-server and a vLLM worker on the tiny model, run a batch of "
        "example prompts through them, print the results, and stop everything.",
    )
    p.add_argument("--prompts", default=None, help="a JSONL file of prompts (default: the bundled examples)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the worker to start")
    p.add_argument(
        "--disagg",
        action="store_true",
        help="a prefill worker and a decode worker instead of one (two engines), a long prompt added "
        "to the batch, and where each prompt was prefilled",
    )
    p.set_defaults(func=cmd_demo)
