"""`jetllm demo`: the whole path in one command — embedded NATS, a real vLLM worker, a batch."""

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
from ..schemas import BatchResult
from .common import TINY_MODEL_NAME


async def _wait_ready(url: str, namespace: str, model: str, proc: subprocess.Popen, timeout: float) -> None:
    from ..producer.fleet import worker_statuses
    from ..subjects.connection import connect
    from ..subjects.names import Names

    nc = await connect(url)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited with code {proc.returncode} before it was ready")
            if any(
                s.state == "serving" and s.model == model
                for s in await worker_statuses(nc, Names(namespace), 0.3)
            ):
                return
            await anyio.sleep(0.3)
        raise TimeoutError(f"no worker ready after {timeout:.0f}s")
    finally:
        await nc.close()


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
    with NatsServer(work / "nats") as server:
        print(f"2/4 nats-server with JetStream at {server.url}", file=sys.stderr, flush=True)
        log_path = work / "worker.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jetllm",
                    "worker",
                    "--nats",
                    server.url,
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
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            print(f"3/4 starting a vLLM worker (log: {log_path}) ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            run(_wait_ready, server.url, "default", TINY_MODEL_NAME, proc, args.timeout)
            print(f"    worker ready in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
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
            print("(the tiny model has random weights: its text is gibberish by design)", file=sys.stderr)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            print(f"worker stopped (exit code {code}); server stopping", file=sys.stderr)
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
    p.set_defaults(func=cmd_demo)
