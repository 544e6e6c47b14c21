"""The three ways the benchmark drives the same engine: directly, through jetllm, over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio

from ..aio import task_group
from ..cpus import engine_cores
from ..spawn import jetllm_command, stop
from ..workers.engine import EngineOptions
from .workload import Recorder, Summary, Timing, Workload, percentile, summarize

DIRECT = "AsyncLLM direct"
JETLLM = "through jetllm"
OPENAI = "vLLM OpenAI server (HTTP streaming)"
GATEWAY = "jetllm gateway (HTTP streaming)"
"""The targets' labels in reports, by which the ratios find them."""


async def _drive(prompts: list[list[int]], concurrency: int, one) -> tuple[list[Timing], float, int]:
    timings: list[Timing] = []
    errors = 0
    limiter = anyio.Semaphore(concurrency)

    async def run(p: list[int]) -> None:
        nonlocal errors
        async with limiter:
            try:
                timings.append(await one(p))
            except Exception as exc:
                errors += 1
                if errors <= 3:
                    print(f"  request failed: {type(exc).__name__}: {exc}", file=sys.stderr)

    started = time.perf_counter()
    async with task_group() as tg:
        for p in prompts:
            tg.start_soon(run, p)
    return timings, time.perf_counter() - started, errors


async def run_direct(opts: EngineOptions, work: Workload) -> Summary:
    """AsyncLLM in this process, called the way a Python program would call it."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    from ..workers.engine.vllm_engine import VllmEngine

    engine = await VllmEngine.start(opts)
    llm = engine.llm
    params = SamplingParams(
        temperature=0,
        max_tokens=work.output_len,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )

    async def one(prompt: list[int]) -> Timing:
        rec = Recorder(time.perf_counter())
        async for out in llm.generate(tokens_input(prompt), params, uuid.uuid4().hex):
            rec.chunk(time.perf_counter(), len(out.outputs[0].token_ids))
        return rec.done(time.perf_counter())

    try:
        vocab = engine.facts.vocab_size or 500
        await _drive(work.prompts(vocab, work.warmup, offset=1), work.concurrency, one)
        timings, seconds, errors = await _drive(work.prompts(vocab), work.concurrency, one)
    finally:
        await engine.close()
    return summarize(DIRECT, timings, seconds, errors)


def engine_cli_args(opts: EngineOptions) -> list[str]:
    args = ["--model", opts.model]
    if opts.served_model_name:
        args += ["--served-model-name", opts.served_model_name]
    for flag, value in (
        ("--max-model-len", opts.max_model_len),
        ("--dtype", opts.dtype),
        ("--block-size", opts.block_size),
        ("--max-num-seqs", opts.max_num_seqs),
    ):
        if value is not None:
            args += [flag, str(value)]
    return args


def worker_command(opts: EngineOptions, url: str, namespace: str) -> list[str]:
    """`jetllm worker` on the same engine arguments as the direct target's."""
    cmd = jetllm_command(
        "worker",
        url,
        "--namespace",
        namespace,
        *engine_cli_args(opts),
        "--kv-cache-bytes",
        str(opts.kv_cache_bytes or (1 << 30)),
        "--slots",
        str(opts.max_num_seqs or 256),
        "--kv-events" if opts.kv_events else "--no-kv-events",
    )
    for key, value in opts.extra.items():
        cmd += ["--engine-arg", f"{key}={json.dumps(value)}"]
    return cmd


DISAGG_WORKERS = (("--role", "prefill"), ("--role", "decode", "--disagg-threshold", "1"))
"""The disaggregated target: a prefill and a decode worker, on the same cores as one aggregated."""


@contextlib.contextmanager
def worker_processes(
    opts: EngineOptions, url: str, namespace: str, log_dir: Path, workers: tuple[tuple[str, ...], ...]
) -> Iterator[None]:
    """`jetllm worker` processes for the benchmark (`workers` gives each one's extra arguments)."""
    cmd = worker_command(opts, url, namespace)
    logs = [open(log_dir / f"bench-worker{i}.log", "wb") for i in range(len(workers))]
    ranks = (opts.data_parallel_size or 1) > 1  # vLLM splits the cores among its ranks itself
    procs = [
        subprocess.Popen(
            [*cmd, *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **({} if ranks else engine_cores(i, len(workers)))},
        )
        for i, (extra, log) in enumerate(zip(workers, logs, strict=True))
    ]
    try:
        yield
    finally:
        stop(*procs)
        for log in logs:
            log.close()


async def run_jetllm(
    opts: EngineOptions,
    work: Workload,
    url: str,
    log_dir: Path,
    vocab: int,
    workers: tuple[tuple[str, ...], ...] = ((),),
    label: str = JETLLM,
) -> Summary:
    """`jetllm worker` processes (one aggregated by default; `workers` gives each one's extra
    arguments); this process is the producer, streaming over NATS."""
    from ..producer import Client
    from ..producer.fleet import wait_for_workers
    from ..producer.traces import trace_records
    from ..schemas import (
        GenerateRequest,
        SamplingOptions,
        StopConditions,
        TokensFrame,
        TokensPrompt,
    )

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with worker_processes(opts, url, namespace, log_dir, workers):
        async with Client(url, namespace=namespace, heartbeat_timeout=60) as client:
            await wait_for_workers(client.nc, client.names, model=opts.name, count=len(workers), timeout=600)

            measured: dict[str, tuple[float, float | None]] = {}
            """Request id -> the wall clock at its call and at its first token (trace records' clock)."""

            async def one(prompt: list[int]) -> Timing:
                req = GenerateRequest(
                    request_id=uuid.uuid4().hex,
                    model=opts.name,
                    prompt=TokensPrompt(prompt),
                    sampling=SamplingOptions(temperature=0),
                    stop=StopConditions(max_tokens=work.output_len, ignore_eos=True),
                )
                wall, rec = time.time(), Recorder(time.perf_counter())
                async for frame in client.generate(req):
                    if isinstance(frame, TokensFrame):
                        rec.chunk(time.perf_counter(), len(frame.token_ids))
                measured[req.request_id] = (wall, None if rec.first is None else wall + rec.first - rec.start)
                return rec.done(time.perf_counter())

            await _drive(work.prompts(vocab, work.warmup, offset=1), work.concurrency, one)
            measured.clear()
            timings, seconds, errors = await _drive(work.prompts(vocab), work.concurrency, one)
            await anyio.sleep(0.5)  # the last trace records are published after the final frames
            hops = [r for r in await trace_records(client.js, client.names) if r.request_id in measured]
    summary = summarize(label, timings, seconds, errors)
    summary.queued_p50_ms = _p50_ms(r.pulled_at - r.queued_at for r in hops)
    summary.worker_ttft_p50_ms = _p50_ms(r.first_token_at - r.pulled_at for r in hops if r.first_token_at)
    summary.worker_accept_p50_ms = _p50_ms(r.accepted_at - r.pulled_at for r in hops if r.accepted_at)
    summary.worker_wait_p50_ms = _p50_ms(r.started_at - r.pulled_at for r in hops if r.started_at)
    summary.publish_p50_ms = _p50_ms(r.queued_at - measured[r.request_id][0] for r in hops)
    summary.frame_back_p50_ms = _p50_ms(
        first - r.first_token_at
        for r in hops
        if r.first_token_at and (first := measured[r.request_id][1]) is not None
    )
    return summary


def _p50_ms(seconds: Iterable[float]) -> float:
    return percentile(list(seconds), 50) * 1000


async def _wait_healthy(http: Any, base: str, proc: subprocess.Popen, log_name: str) -> None:
    """Until the server answers /health (model loaded); its early exit or 10 minutes end the wait."""
    import aiohttp

    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM OpenAI server exited ({proc.returncode}); see {log_name}")
        try:
            async with http.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM OpenAI server did not become healthy")
        await anyio.sleep(0.5)


def _streamed_completion(http: Any, base: str, model: str, output_len: int) -> Any:
    """One streamed /v1/completions request of the workload, timed (the token ids of each chunk
    counted, as both servers send them when asked with `return_token_ids`)."""

    async def one(prompt: list[int]) -> Timing:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        rec = Recorder(time.perf_counter())
        async with http.post(f"{base}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids")
                    rec.chunk(time.perf_counter(), len(ids) if ids is not None else 1)
        return rec.done(time.perf_counter())

    return one


async def run_gateway(opts: EngineOptions, work: Workload, url: str, log_dir: Path, vocab: int) -> Summary:
    """A `jetllm worker` and `jetllm gateway` (processes), driven over HTTP exactly as vLLM's server is."""
    from ..natsserver import free_port

    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    port = free_port()
    cmd = jetllm_command("gateway", url, "--namespace", namespace, "--port", str(port))
    log = open(log_dir / "bench-gateway.log", "wb")
    with worker_processes(opts, url, namespace, log_dir, ((),)):
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            timings, seconds, errors = await _over_http(
                f"http://127.0.0.1:{port}", proc, log.name, opts, work, vocab
            )
        finally:
            stop(proc, grace=30)
            log.close()
    return summarize(GATEWAY, timings, seconds, errors)


def _serve_flag(key: str, value: Any) -> list[str]:
    """An engine argument as `vllm serve` takes it on its command line."""
    flag = key.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{flag}" if value else f"--no-{flag}"]
    return [f"--{flag}", value if isinstance(value, str) else json.dumps(value)]


def openai_server_args(opts: EngineOptions, port: int, on_cpu: bool) -> list[str]:
    """`vllm serve`'s arguments for the same engine as the worker's (workers/engine/args.py),
    the platform's rules included: on CPU, whole prompts only."""
    from ..workers.engine.args import whole_prompts

    args = [
        *engine_cli_args(opts),
        "--kv-cache-memory-bytes",
        str(opts.kv_cache_bytes or (1 << 30)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if opts.enforce_eager is not False:
        args.append("--enforce-eager")
    for key, value in {**whole_prompts(on_cpu), **opts.extra}.items():
        args += _serve_flag(key, value)
    return args


async def run_openai(opts: EngineOptions, work: Workload, log_dir: Path, vocab: int) -> Summary:
    """vLLM's own OpenAI server with the same engine arguments, over its streaming API."""
    from vllm.platforms import current_platform

    from ..natsserver import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *openai_server_args(opts, port, current_platform.is_cpu()),
    ]
    log = open(log_dir / "bench-openai-server.log", "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        timings, seconds, errors = await _over_http(
            f"http://127.0.0.1:{port}", proc, log.name, opts, work, vocab
        )
    finally:
        stop(proc)
        log.close()
    return summarize(OPENAI, timings, seconds, errors)


async def _over_http(
    base: str, proc: subprocess.Popen, log_name: str, opts: EngineOptions, work: Workload, vocab: int
) -> tuple[list[Timing], float, int]:
    """The workload, warm-up first, as streaming completions against an OpenAI server at `base`."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    conn = aiohttp.TCPConnector(limit=work.concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:
        await _wait_healthy(http, base, proc, log_name)
        one = _streamed_completion(http, base, opts.name, work.output_len)
        await _drive(work.prompts(vocab, work.warmup, offset=1), work.concurrency, one)
        return await _drive(work.prompts(vocab), work.concurrency, one)
