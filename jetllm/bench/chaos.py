"""`jetllm bench-chaos`: the same workload with and without workers SIGKILLed under it.

Reports throughput both ways, how many requests moved, and the resume latency: from a kill to
the next token the producer receives for each request that was running on the killed worker.
Outputs of the run with kills are checked against the run without (greedy decoding).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO

import anyio
import msgspec
import nats.errors

from ..aio import run, task_group
from ..cpus import engine_cores
from ..producer import Client
from ..producer.fleet import wait_for_workers, worker_statuses
from ..schemas import (
    AcceptedFrame,
    FinalFrame,
    GenerateRequest,
    SamplingOptions,
    StopConditions,
    TokensFrame,
    TokensPrompt,
)
from ..spawn import jetllm_command, stop
from .box import BoxWatch
from .run import _vocab, command_line, publish
from .workload import percentile

MARKS = ("<!-- chaos:begin -->", "<!-- chaos:end -->")


class Run(msgspec.Struct, kw_only=True):
    label: str
    seconds: float
    tokens: int
    tokens_per_s: float
    kills: int
    migrated: int
    resume_p50_s: float | None = None
    resume_p99_s: float | None = None
    resume_s: list[float] = []
    """Per request running on a killed worker: kill to its next token, sorted."""
    free_slots: list[int] = []
    """Per kill: free slots on the other serving workers just before it (their status)."""
    gone_s: list[float] = []
    """Per kill: seconds until the server answered "no responders" for the victim's ping subject."""
    outputs: dict[str, list[int]] = {}


class Fleet:
    def __init__(
        self, url: str, namespace: str, model: str, served: str, log_dir: Path, n: int, extra: list[str]
    ) -> None:
        self.args = jetllm_command(
            "worker", url, "--namespace", namespace, "--model", model, "--served-model-name", served, *extra
        )
        self.log_dir = log_dir
        self.count = n
        self.logs: list[BinaryIO] = []
        self.procs: list[subprocess.Popen] = [self._start(i) for i in range(n)]

    def _start(self, i: int) -> subprocess.Popen:
        log = open(self.log_dir / f"chaos-worker-{i}-{uuid.uuid4().hex[:4]}.log", "wb")
        self.logs.append(log)
        return subprocess.Popen(
            self.args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **engine_cores(i, self.count)},
            start_new_session=True,
        )

    def kill(self, pid: int) -> None:
        for i, p in enumerate(self.procs):
            if p.pid == pid:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                self.procs[i] = self._start(i)

    def stop(self) -> None:
        stop(*self.procs, group=True)
        for log in self.logs:
            log.close()


def _resume_times(
    kill_times: list[tuple[float, str]],
    arrivals: dict[str, list[float]],
    on: dict[str, list[tuple[float, str]]],
    ended: dict[str, float],
) -> list[float]:
    """For each request a kill interrupted (running on the killed worker, not ended yet): the time
    from the kill to its next token from the worker that took it over (tokens the killed worker
    sent just before it died can still arrive after the kill; they do not count). Read from the
    frames, not from a status taken before the kill, which under load misses requests the worker
    took meanwhile."""
    resume = []
    for at, victim in kill_times:
        for rid, accepts in on.items():
            before = [worker for t, worker in accepts if t < at]
            if not before or before[-1] != victim or ended.get(rid, at) < at:
                continue
            moved = [t for t, worker in accepts if t > at]
            later = [t for t in arrivals.get(rid, []) if moved and t > moved[0]]
            if later:
                resume.append(later[0] - at)
    return resume


async def _watch_gone(client: Client, instance: str, since: float, gone: list[float]) -> None:
    """Ping a killed worker until the server answers "no responders": when producers can know."""
    with anyio.move_on_after(30):
        while True:
            try:
                await client.nc.request(client.names.instance_control(instance, "ping"), b"", timeout=0.05)
            except nats.errors.NoRespondersError:
                gone.append(time.monotonic() - since)
                return
            except nats.errors.TimeoutError:
                pass
            await anyio.sleep(0.01)


async def _workload(client: Client, fleet: Fleet, served: str, args: argparse.Namespace, kills: int) -> Run:
    rng = random.Random(3)
    vocab = args.vocab
    requests = [
        GenerateRequest(
            request_id=f"chaos-{uuid.uuid4().hex}",
            model=served,
            prompt=TokensPrompt([rng.randrange(4, vocab) for _ in range(args.prompt_len)]),
            sampling=SamplingOptions(temperature=0),
            stop=StopConditions(max_tokens=args.output_len, ignore_eos=True),
        )
        for _ in range(args.requests)
    ]
    arrivals: dict[str, list[float]] = {r.request_id: [] for r in requests}
    on: dict[str, list[tuple[float, str]]] = {r.request_id: [] for r in requests}
    """Per request: when it was accepted, by which worker."""
    ended: dict[str, float] = {}
    attempts: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    kill_times: list[tuple[float, str]] = []
    free_slots: list[int] = []
    gone: list[float] = []
    limiter = anyio.Semaphore(args.concurrency)

    async def one(i: int, r: GenerateRequest) -> None:
        async with limiter:
            tokens: list[int] = []
            async for f in client.generate(r):
                if isinstance(f, TokensFrame):
                    arrivals[r.request_id].append(time.monotonic())
                    tokens.extend(f.token_ids)
                elif isinstance(f, AcceptedFrame):
                    attempts[r.request_id] = f.attempt
                    on[r.request_id].append((time.monotonic(), f.worker))
                elif not isinstance(f, FinalFrame):
                    raise RuntimeError(f"{r.request_id} failed: {f}")
            ended[r.request_id] = time.monotonic()
            outputs[i] = tokens

    async def killer() -> None:
        for _ in range(kills):
            await anyio.sleep(args.kill_every)
            while True:  # another worker must be serving: this measures resume, not a full outage
                statuses = await worker_statuses(client.nc, client.names)
                busy = [s for s in statuses if s.in_flight]
                if busy and sum(s.state == "serving" for s in statuses) >= 2:
                    break
                await anyio.sleep(0.2)
            victim = random.Random(len(kill_times)).choice(busy)
            free_slots.append(
                sum(
                    s.slots - s.in_flight
                    for s in statuses
                    if s.instance != victim.instance and s.state == "serving"
                )
            )
            kill_times.append((time.monotonic(), victim.instance))
            async with task_group() as tg:
                tg.start_soon(_watch_gone, client, victim.instance, kill_times[-1][0], gone)
                await anyio.to_thread.run_sync(fleet.kill, victim.pid)  # frames keep arriving meanwhile

    started = time.monotonic()
    async with task_group() as tg:
        if kills:
            tg.start_soon(killer)
        async with task_group() as reqs:
            for i, r in enumerate(requests):
                reqs.start_soon(one, i, r)
        tg.cancel_scope.cancel()
    seconds = time.monotonic() - started
    resume = _resume_times(kill_times, arrivals, on, ended)
    total = sum(len(o) for o in outputs.values())
    return Run(
        label="with kills" if kills else "without kills",
        seconds=seconds,
        tokens=total,
        tokens_per_s=total / seconds,
        kills=len(kill_times),
        migrated=sum(1 for a in attempts.values() if a > 1),
        resume_p50_s=statistics.median(resume) if resume else None,
        resume_p99_s=percentile(resume, 99) if resume else None,
        resume_s=sorted(resume),
        free_slots=free_slots,
        gone_s=gone,
        outputs={str(i): o for i, o in sorted(outputs.items())},
    )


class CancelTimes(msgspec.Struct, kw_only=True):
    """Cancel to `cancelled` error frame (the worker sends it once the engine dropped the request),
    beside the engine's step time (the inter-token interval) under the same load."""

    cancels: int
    p50_s: float
    p99_s: float
    step_p50_s: float


async def _cancel_latency(client: Client, served: str, args: argparse.Namespace) -> CancelTimes:
    rng = random.Random(5)
    waits: list[float] = []
    steps: list[float] = []

    async def one(i: int) -> None:
        r = GenerateRequest(
            request_id=f"cancel-{uuid.uuid4().hex}",
            model=served,
            prompt=TokensPrompt([rng.randrange(4, args.vocab) for _ in range(args.prompt_len)]),
            stop=StopConditions(max_tokens=args.output_len * 4, ignore_eos=True),
        )
        after = rng.randrange(5, args.output_len)
        got, last, cancelled_at = 0, None, None
        async for f in client.generate(r):
            if isinstance(f, TokensFrame):
                now = time.monotonic()
                if last is not None and cancelled_at is None:
                    steps.append((now - last) / len(f.token_ids))
                last, got = now, got + len(f.token_ids)
                if got >= after and cancelled_at is None:
                    cancelled_at = time.monotonic()
                    await client.cancel(r.request_id)
            elif not isinstance(f, AcceptedFrame):
                if cancelled_at is not None:
                    waits.append(time.monotonic() - cancelled_at)
                break

    async with task_group() as tg:
        for i in range(args.concurrency):
            tg.start_soon(one, i)
    return CancelTimes(
        cancels=len(waits),
        p50_s=statistics.median(waits),
        p99_s=percentile(waits, 99),
        step_p50_s=statistics.median(steps),
    )


async def _main(args: argparse.Namespace, log_dir: Path) -> tuple[Run, Run, CancelTimes]:
    from .. import tinymodel
    from ..natsserver import NatsServer

    model, served = args.model, args.served_model_name
    if model is None:
        model, served = str(tinymodel.ensure()), served or "tiny"
    served = served or model
    if args.slots is None:
        args.slots = args.concurrency
    args.vocab = _vocab(type("O", (), {"model": model})())
    extra = [
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(256 << 20),
        "--slots",
        str(args.slots),
        "--ack-wait",
        str(args.ack_wait),
    ]
    with NatsServer(log_dir / "nats") as server:
        results = []
        for kills in (0, args.kills):
            namespace = f"chaos-{uuid.uuid4().hex[:6]}"
            fleet = Fleet(server.url, namespace, model, served, log_dir, args.workers, extra)
            try:
                async with Client(
                    server.url,
                    namespace=namespace,
                    heartbeat_timeout=args.heartbeat_timeout,
                    probe_after=args.probe_after,
                ) as c:
                    await wait_for_workers(c.nc, c.names, model=served, count=args.workers, timeout=600)
                    print(
                        f"bench-chaos: {args.requests} requests, {f'{kills} kills' if kills else 'no kills'} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.append(await _workload(c, fleet, served, args, kills))
                    if not kills:
                        print("bench-chaos: cancelling requests mid-decode ...", file=sys.stderr, flush=True)
                        cancels = await _cancel_latency(c, served, args)
            finally:
                fleet.stop()
    return results[0], results[1], cancels


def report(
    base: Run, chaos: Run, cancels: CancelTimes, args: argparse.Namespace, command: str, box: str = ""
) -> str:
    """`box`: BoxWatch.line()."""
    same = base.outputs == chaos.outputs
    p50 = f"{chaos.resume_p50_s:.2f} s" if chaos.resume_p50_s is not None else "-"
    p99 = f"{chaos.resume_p99_s:.2f} s" if chaos.resume_p99_s is not None else "-"
    return (
        f"Workload: {args.requests} greedy requests, {args.concurrency} concurrent, {args.prompt_len}-token prompts, "
        f"{args.output_len} tokens each, {args.workers} workers ({args.slots} slots each); in the second run a busy "
        f"worker is SIGKILLed every {args.kill_every:.0f} s (while another serves) and restarted ({args.kills} "
        f'kills); producers ping a worker after {args.probe_after:.2f} s of silence (only "no '
        'responders", a closed connection, counts as death) and read the request log after '
        f"{args.heartbeat_timeout:.1f} s.\n\n"
        f"Command: `{command}`\n\n"
        "| run | output tok/s | seconds | kills | requests moved | resume p50 | resume p99 |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
        f"| without kills | {base.tokens_per_s:,.0f} | {base.seconds:.1f} | 0 | 0 | - | - |\n"
        f"| with kills | {chaos.tokens_per_s:,.0f} | {chaos.seconds:.1f} | {chaos.kills} | {chaos.migrated} | {p50} | {p99} |\n\n"
        f"- every output of the run with kills equals the run without: **{'yes' if same else 'NO'}**\n"
        f"- resume latency: from a kill to the next token of each request that was running on the killed "
        f"worker ({len(chaos.resume_s)} requests; free slots on the other workers at the kills: "
        f"{', '.join(map(str, chaos.free_slots)) or '-'}; a request beyond those waits for a slot): "
        f"{', '.join(f'{t:.2f}' for t in chaos.resume_s) or '-'} s\n"
        f'- from a kill to the server answering "no responders" for the victim (what a producer\'s ping '
        f"waits for): {', '.join(f'{t:.2f}' for t in chaos.gone_s) or '-'} s\n"
        f"- throughput with kills / without: {chaos.tokens_per_s / base.tokens_per_s:.2f}x (restarted workers "
        "spend ~15-30 s loading the engine, during which the others carry the load)\n\n"
        f"Cancellation ({cancels.cancels} requests, {args.concurrency} concurrent, each cancelled mid-decode): "
        f"from `Client.cancel` to the `cancelled` error frame, which the worker sends once the engine has "
        f"dropped the request: p50 {cancels.p50_s * 1000:.0f} ms, p99 {cancels.p99_s * 1000:.0f} ms; one engine "
        f"step (inter-token interval) under the same load: {cancels.step_p50_s * 1000:.0f} ms.\n"
        + (f"\n{box}\n" if box else "")
    )


def cmd_chaos(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    log_dir = Path(tempfile.mkdtemp(prefix="jetllm-chaos-"))
    box = BoxWatch.start()
    base, chaos, cancels = run(_main, args, log_dir)
    text = report(base, chaos, cancels, args, command_line("bench-chaos"), box.line())
    publish(text, log_dir, write=args.write, marks=MARKS)
    return 0 if base.outputs == chaos.outputs else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-chaos",
        help="throughput and resume latency with workers SIGKILLed under load",
        description="Run one workload twice on a few workers: undisturbed, then with a busy worker "
        "SIGKILLed (and restarted) every few seconds; report throughput, requests moved and resume "
        "latency, and check the outputs are identical.",
    )
    p.add_argument("--requests", type=int, default=240, help="requests per run")
    p.add_argument("--concurrency", type=int, default=24, help="requests in flight at once")
    p.add_argument("--prompt-len", type=int, default=20, help="tokens per prompt")
    p.add_argument("--output-len", type=int, default=200, help="generated tokens per request (greedy)")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="slots per worker (default: the concurrency, so the survivors have a slot for every moved request)",
    )
    p.add_argument("--kills", type=int, default=2, help="SIGKILLs in the second run")
    p.add_argument("--kill-every", type=float, default=4.0, help="seconds between kills")
    p.add_argument("--ack-wait", type=float, default=10.0, help="the queue's ack_wait (redelivery backstop)")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=2.0,
        help="producer: silence before reading the request log for a result",
    )
    p.add_argument(
        "--probe-after", type=float, default=0.25, help="producer: silence before pinging the worker"
    )
    p.add_argument("--model", default=None, help="default: the tiny model")
    p.add_argument("--served-model-name", default=None, help="name of the model on the wire")
    p.add_argument("--write", default=None, help="replace the chaos section of this markdown file")
    p.set_defaults(func=cmd_chaos)
