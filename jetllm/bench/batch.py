"""`jetllm bench-batch`: the same lines through the durable batch API and through vLLM's offline
`LLM.generate`, with the same engine arguments, their rounds alternating.

Offline runs in a child process that keeps its engine up between rounds (offline.py; an idle
vLLM engine takes no CPU); the batch API runs on an embedded NATS with one `jetllm worker` process and a
batch runner in this process. Both engines are started before the first round, and the rounds
take turns, so a box whose speed drifts during the run touches every target alike. Every clock
starts when the work is handed over (the prompts to `generate`, the batch to the runner) and
stops when the last output is in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ..aio import run, task_group
from ..batches import plan
from ..spawn import stop
from ..workers.engine import EngineOptions
from .box import BoxWatch, cpu_seconds
from .offline import OFFLINE, OFFLINE_IDS, OfflineChild
from .workload import Workload


class Round(msgspec.Struct, frozen=True):
    seconds: float
    tokens: int
    cpu: dict[str, float] = {}
    """CPU seconds of the round by process outside the engine (offline's front end; jetllm's
    worker, NATS server and producer)."""


class Figures(msgspec.Struct, kw_only=True):
    label: str
    lines: int
    seconds: float
    """The median of `rounds`."""
    output_tokens: int
    rounds: list[float] = []
    cpu_ms_per_line: dict[str, float] = {}
    """CPU time outside the engine's own processes, per line, by process (each the median of the
    rounds): offline's front-end process, or jetllm's worker, NATS server and producer."""

    @classmethod
    def of(cls, label: str, lines: int, runs: list[Round]) -> Figures:
        return cls(
            label=label,
            lines=lines,
            seconds=statistics.median(r.seconds for r in runs),
            output_tokens=runs[0].tokens,
            rounds=[r.seconds for r in runs],
            cpu_ms_per_line={
                name: statistics.median(r.cpu.get(name, 0.0) for r in runs) * 1000 / lines
                for name in runs[0].cpu
            }
            if lines
            else {},
        )

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


async def run_targets(
    offline: OfflineChild,
    opts: EngineOptions,
    prompts: list[list[int]],
    output_len: int,
    url: str,
    log_dir: Path,
    windows: list[tuple[int, float, int]],
    in_flight: int,
    rounds: int,
    server_pid: int | None = None,
) -> list[Figures]:
    """Offline, the batch API, and for scale the same lines streamed through the same worker by
    one producer (`Client.complete`, `in_flight` at a time): what the plane costs apart from the
    runner. Offline's rows come first: the reference."""
    from ..batches.runner import BatchRunner
    from ..batches.service import BatchService
    from ..openai.endpoints import COMPLETIONS
    from ..producer import Client
    from ..producer.fleet import wait_for_workers
    from .targets import worker_command

    namespace = f"bb-{uuid.uuid4().hex[:8]}"
    cmd = worker_command(opts, url, namespace)
    log = open(log_dir / "bench-batch-worker.log", "wb")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )

    def body(p: list[int]) -> dict:
        return {
            "model": opts.name,
            "prompt": p,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
        }

    def jsonl(ps: list[list[int]], tag: str) -> bytes:
        return b"".join(
            json.dumps(
                {"custom_id": f"{tag}-{i}", "method": "POST", "url": COMPLETIONS, "body": body(p)}
            ).encode()
            + b"\n"
            for i, p in enumerate(ps)
        )

    try:
        async with Client(url, namespace=namespace, heartbeat_timeout=60) as client:
            service = await BatchService.open(client.js, client.names)
            await wait_for_workers(client.nc, client.names, model=opts.name, count=1, timeout=600)
            runner = BatchRunner(client, service)
            async with task_group() as tg:
                tg.start_soon(runner.serve)

                server = {"NATS server": [server_pid]} if server_pid is not None else {}
                plane = {"worker": [proc.pid], **server, "producer": [os.getpid()]}
                front_end = {"front end": [offline.proc.pid], "producer": [os.getpid()]}

                async def measured(pids: dict[str, list[int]], fn: Any, *args: Any) -> Round:
                    before = {name: cpu_seconds(p) for name, p in pids.items()}
                    seconds, tokens = await fn(*args)
                    spent = {name: cpu_seconds(p) - before[name] for name, p in pids.items()}
                    return Round(seconds, tokens, spent)

                async def offline_round(detokenize: bool = True) -> tuple[float, int]:
                    return await anyio.to_thread.run_sync(offline.round, detokenize)

                async def one(ps: list[list[int]], tag: str) -> tuple[float, int]:
                    f = await service.upload(jsonl(ps, tag), f"{tag}.jsonl", "batch")
                    started = time.perf_counter()
                    state = await service.create(f.id, COMPLETIONS)
                    while state.status not in ("completed", "failed", "cancelled", "expired"):
                        await anyio.sleep(0.05)
                        state = await service.get(state.id)
                    seconds = time.perf_counter() - started
                    if state.status != "completed" or state.output_file_id is None:
                        raise RuntimeError(f"batch {state.id} ended {state.status}: {state.errors}")
                    out = (await service.content(state.output_file_id)).splitlines()
                    tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out)
                    return seconds, tokens

                await one(prompts[:8], "warmup")
                offline_runs: list[Round] = []
                streamed: list[Round] = []
                batched: dict[tuple[int, float, int], list[Round]] = {w: [] for w in windows}
                targets: list[tuple[int, float, int] | str] = ["offline", "streamed", *windows]
                for n in range(rounds):  # alternating, so drift on the box touches all alike
                    for target in targets if n % 2 == 0 else targets[::-1]:
                        if target == "offline":
                            offline_runs.append(await measured(front_end, offline_round))
                        elif target == "streamed":
                            streamed.append(
                                await measured(plane, _streamed, client, prompts, in_flight, body)
                            )
                        else:
                            assert isinstance(target, tuple)
                            runner.pacing = dataclasses.replace(
                                runner.pacing, window=target[0], refill=target[1], shard=target[2]
                            )
                            tag = f"measured{n}w{target[0]}r{target[1]}s{target[2]}"
                            batched[target].append(await measured(plane, one, prompts, tag))
                ids_only = await measured(front_end, offline_round, False)
                tg.cancel_scope.cancel()
    finally:
        stop(proc)
        log.close()
    return [
        Figures.of(OFFLINE, len(prompts), offline_runs),
        Figures.of(OFFLINE_IDS, len(prompts), [ids_only]),
        Figures.of(f"jetllm, streamed by one producer ({in_flight} in flight)", len(prompts), streamed),
        *(
            Figures.of(
                f"jetllm batch API (window {w}, refill {refill:g} s, {_sharded(shard)})", len(prompts), runs
            )
            for (w, refill, shard), runs in batched.items()
        ),
    ]


def _sharded(shard: int) -> str:
    return f"shards of up to {shard} lines" if shard > 1 else "a job a line"


async def _streamed(client: Any, prompts: list[list[int]], window: int, body: Any) -> tuple[float, int]:
    """Seconds and output tokens."""
    from ..openai.endpoints import COMPLETIONS, prepare

    limiter = anyio.Semaphore(window)
    tokens = 0
    run_id = uuid.uuid4().hex[:8]

    async def one(i: int) -> None:
        nonlocal tokens
        async with limiter:
            request = prepare(COMPLETIONS, body(prompts[i]), f"s-{run_id}-{i}").job.request
            done = await client.complete(request)
            tokens += done.usage.completion_tokens

    started = time.perf_counter()
    async with task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - started, tokens


def cmd_bench_batch(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from .. import tinymodel
    from ..cli.common import TINY_MODEL_NAME
    from ..natsserver import NatsServer
    from .run import command_line, publish, section_marks

    model, served = args.model, None
    if model is None:
        model, served = str(tinymodel.ensure()), TINY_MODEL_NAME
    opts = EngineOptions(
        model=model,
        served_model_name=served,
        max_model_len=args.max_model_len,
        dtype=args.dtype or "float32",
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
    )
    vocab = int(json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 500))
    prompts = Workload(
        requests=args.lines, concurrency=1, prompt_len=args.prompt_len, output_len=args.output_len
    ).prompts(vocab)
    log_dir = Path(tempfile.mkdtemp(prefix="jetllm-bench-batch-"))
    windows = [
        (w, r, s) for w, r in _windows(args.batch_window) for s in _shard_sizes(args.batch_shard_lines)
    ]
    box = BoxWatch.start()
    with (
        OfflineChild(opts, prompts, args.output_len, log_dir / "offline.log") as offline,
        NatsServer(log_dir / "nats") as server,
    ):
        rows = run(
            run_targets,
            offline,
            opts,
            prompts,
            args.output_len,
            server.url,
            log_dir,
            windows,
            opts.max_num_seqs or 256,
            args.rounds,
            server.proc.pid if server.proc else None,
        )
    text = report(rows, args, command_line("bench-batch"), box.line())
    publish(text, log_dir, write=args.write, marks=section_marks("bench-batch"))
    return 0


def _windows(text: str) -> list[tuple[int, float]]:
    """`32`, `32:0` (no refill), `32,256`: the runner settings to measure, a row each."""
    try:
        windows = [
            (int(w), float(r or plan.REFILL_SECONDS))
            for w, _, r in (x.partition(":") for x in text.split(","))
        ]
    except ValueError:
        windows = []
    if not windows or min(w for w, _ in windows) < 1 or len(set(windows)) != len(windows):
        raise SystemExit(f"--batch-window: WINDOW or WINDOW:REFILL_SECONDS, comma-separated, got {text!r}")
    return windows


def _shard_sizes(text: str) -> list[int]:
    """`64`, `64,1`: the runner's --batch-shard-lines to measure, a row each (1: a job a line)."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise SystemExit(f"--batch-shard-lines: LINES, comma-separated, got {text!r}")
    return sizes


def report(rows: list[Figures], args: argparse.Namespace, command: str, box: str = "") -> str:
    """The first row is the reference the others are compared with; `box`: BoxWatch.line()."""
    base = rows[0].tokens_per_second
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"Measured {when} on {os.cpu_count()} CPUs.",
        "",
        *([box, ""] if box else []),
        f"`{command}`: {args.lines} lines, {args.prompt_len}-token prompts, {args.output_len} tokens each "
        f"(greedy, ignore_eos, text returned), max_num_seqs {args.max_num_seqs}; medians of the "
        "rounds.",
        "",
        "| target | seconds | output tokens/s | vs offline | CPU outside the engine, ms a line | seconds per round |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = r.tokens_per_second / base if base else 0.0
        each = ", ".join(f"{x:.2f}" for x in r.rounds)
        cpu = f"{sum(r.cpu_ms_per_line.values()):.2f}" if r.cpu_ms_per_line else "-"
        lines.append(
            f"| {r.label} | {r.seconds:.2f} | {r.tokens_per_second:,.0f} | {ratio:.2f}x | {cpu} | {each} |"
        )
    lines += [
        "",
        "CPU outside the engine: the CPU time of every process but the engine's own two (its engine "
        "core and model runner), per line, the median of the rounds; by process:",
        "",
        *(
            f"- {r.label}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in r.cpu_ms_per_line.items())
            for r in rows
            if r.cpu_ms_per_line
        ),
    ]
    return "\n".join(lines) + "\n"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-batch",
        help="throughput: the durable batch API vs vLLM's offline LLM.generate",
        description="Run the same lines through vLLM's offline LLM.generate and through the batch API "
        "(embedded NATS, one worker, one batch runner) with the same engine arguments; report tokens/s.",
    )
    p.add_argument("--lines", type=int, default=512, help="lines in the batch")
    p.add_argument("--prompt-len", type=int, default=30, help="tokens per prompt (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per line (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine argument, both targets")
    p.add_argument("--max-model-len", type=int, default=1024, help="engine argument, both targets")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="engine argument, both targets")
    p.add_argument("--dtype", default=None, help="engine argument (default: float32)")
    p.add_argument("--model", default=None, help="default: the tiny model")
    p.add_argument(
        "--batch-window",
        default=str(plan.DEFAULT_WINDOW),
        help=f"the runner's window: batch jobs waiting in the queue at once (default: {plan.DEFAULT_WINDOW}, "
        "as `jetllm batch-runner`), with :SECONDS its refill (default: "
        f"{plan.REFILL_SECONDS:g}); several, comma-separated, give a row each (e.g. 32,32:0,256)",
    )
    p.add_argument(
        "--batch-shard-lines",
        default=str(plan.SHARD_LINES),
        help=f"the runner's --batch-shard-lines (default: {plan.SHARD_LINES}, as `jetllm batch-runner`); "
        "several, comma-separated, give a row each (e.g. 64,1: shards against a job a line)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed runs per target (medians reported), every target taking its turn each round",
    )
    p.add_argument(
        "--write", default=None, help="put the table into this markdown file (bench-batch section)"
    )
    p.set_defaults(func=cmd_bench_batch)
