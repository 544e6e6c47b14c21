"""`jetllm bench-routing`: the KV-aware router against the shared queue, round-robin and an oracle.

One fleet of `--workers` vLLM workers publishing KV events runs the same shared-prefix workload
(jetllm/bench/prefixload.py) once per policy, every worker's prefix cache reset before each, so each starts
cold:

- shared: every job to the shared queue (whichever worker pulls first);
- round-robin: directed jobs, one worker after another;
- kv: `Client(router=Router(...))`, the router of jetllm/router/ placing each job;
- oracle: directed jobs placed by the benchmark's exact knowledge of where each prefix went.

Per policy: TTFT p50/p90 (submit to first token), output tokens/s over the policy's wall time, and
the cache-hit tokens (sum of `usage.cached_tokens`); then the ratios the issue's targets name.
The model is built by the tiny model's recipe, larger (`--layers`, `--hidden`), so that prefill
costs enough on a CPU for a cache hit to show in TTFT (docs/decisions.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from ..aio import run, task_group
from ..spawn import stop
from ..workers.engine import EngineOptions
from .prefixload import Oracle, PrefixWorkload, RoundRobin, Step, next_prompt
from .routingreport import Outcome, Row, report, summarize, table
from .run import choices, command_line, publish, section_marks

POLICIES = ("shared", "round-robin", "kv", "oracle")
FAKE_WORKER = Path(__file__).resolve().parents[2] / "tests" / "helpers" / "fake_worker.py"
RESET_TIMEOUT = 60.0
FAKE_VOCAB = 97
"""The light test engine's vocabulary (tests/fake_engine.py)."""
SETTLE = 1.5
"""Seconds after a cache reset for its cleared events to reach the stream (and a router)."""


def _unplaced(key: str) -> None:
    return None


Placer = Callable[[str], str | None]
"""The instance for a request of a prefix key; None: the client decides."""


async def drive(client: Any, model: str, work: PrefixWorkload, place: Placer) -> tuple[list[Outcome], float]:
    """The workload's scripts, `concurrency` requests at a time; `place` names the instance of each
    request (None: the client decides, through its router or the shared queue)."""
    from ..schemas import (
        AcceptedFrame,
        ErrorFrame,
        FinalFrame,
        GenerateRequest,
        SamplingOptions,
        StopConditions,
        TokensFrame,
        TokensPrompt,
    )

    outcomes: list[Outcome] = []
    limiter = anyio.Semaphore(work.concurrency)
    run_id = uuid.uuid4().hex[:8]

    async def one(step: Step, prompt: list[int]) -> list[int]:
        out = Outcome(key=step.key)
        outcomes.append(out)
        answer: list[int] = []
        session = f"{run_id}-{step.key}" if step.key.startswith("s") else None
        req = GenerateRequest(
            request_id=f"route-{uuid.uuid4().hex}",
            model=model,
            prompt=TokensPrompt(prompt),
            sampling=SamplingOptions(temperature=0),
            stop=StopConditions(max_tokens=work.output_len, ignore_eos=True),
            session_id=session,
        )
        instance = place(step.key)
        started = time.perf_counter()
        try:
            async for frame in client.generate(req, instance=instance):
                if isinstance(frame, AcceptedFrame):
                    out.worker = frame.worker
                elif isinstance(frame, TokensFrame):
                    if out.ttft is None and frame.token_ids:
                        out.ttft = time.perf_counter() - started
                    answer.extend(frame.token_ids)
                elif isinstance(frame, FinalFrame):
                    out.prompt_tokens = frame.usage.prompt_tokens
                    out.cached_tokens = frame.usage.cached_tokens
                    out.output_tokens = frame.usage.completion_tokens
                elif isinstance(frame, ErrorFrame):
                    out.error = f"{frame.code.value}: {frame.message}"
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        if out.error is not None and sum(o.error is not None for o in outcomes) <= 3:
            print(f"  request failed: {out.error}", file=sys.stderr, flush=True)
        return answer

    async def script(steps: list[Step]) -> None:
        prompt: list[int] = []
        answer: list[int] = []
        for step in steps:
            prompt = next_prompt(prompt, answer, step)
            async with limiter:
                answer = await one(step, prompt)

    started = time.perf_counter()
    async with task_group() as tg:
        for steps in work.scripts():
            tg.start_soon(script, steps)
    return outcomes, time.perf_counter() - started


async def reset_caches(client: Any, model: str, count: int, settle: float = SETTLE) -> None:
    """Every worker's prefix cache emptied (a worker still holding blocks refuses: asked again)."""
    from ..producer.fleet import ask
    from ..schemas import ControlDone

    done: set[str] = set()
    last: list[Any] = []
    with anyio.fail_after(RESET_TIMEOUT):
        while len(done) < count:
            last = await ask(client.nc, client.names, "reset-prefix-cache", model=model, timeout=10)
            done |= {r.instance for r in last if isinstance(r, ControlDone)}
            if len(done) < count:
                await anyio.sleep(0.5)
    await anyio.sleep(settle)


@contextlib.contextmanager
def fake_workers(url: str, namespace: str, count: int, slots: int, log_dir: Path) -> Iterator[None]:
    """Workers on the light test engine of a source checkout: no prefix cache and no KV events,
    so every policy runs and nothing is cached (what the command's smoke test needs)."""
    if not FAKE_WORKER.is_file():
        raise SystemExit(
            "--engine fake runs the light test engine of a source checkout "
            f"(tests/helpers/fake_worker.py), which {FAKE_WORKER.parents[2]} lacks; use --engine vllm"
        )
    cmd = [sys.executable, "-m", "tests.helpers.fake_worker", url, namespace, "--slots", str(slots)]
    procs = []
    for i in range(count):
        with open(log_dir / f"fake-worker{i}.log", "wb") as log:
            procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=FAKE_WORKER.parents[2])
            )
    try:
        yield
    finally:
        stop(*procs, grace=30)


async def run_policies(
    args: argparse.Namespace, work: PrefixWorkload, opts: EngineOptions, url: str, log_dir: Path
) -> list[Row]:
    from ..producer import Client
    from ..producer.fleet import wait_for_workers
    from ..router import Router
    from ..subjects.policy import QueuePolicy
    from ..subjects.setup import ensure_kv_events_stream
    from .targets import worker_processes

    namespace = f"route-{uuid.uuid4().hex[:8]}"
    model = opts.name
    if args.engine == "fake":
        workers_running = fake_workers(url, namespace, args.workers, args.slots, log_dir)
    else:
        workers_running = worker_processes(opts, url, namespace, log_dir, ((),) * args.workers)
    with workers_running:
        async with Client(url, namespace=namespace, heartbeat_timeout=120) as client:
            found = await wait_for_workers(
                client.nc, client.names, model=model, count=args.workers, timeout=900
            )
            workers = sorted(s.instance for s in found)
            print(
                f"bench-routing: {len(workers)} workers serving; warming up ...", file=sys.stderr, flush=True
            )
            warm = PrefixWorkload(
                groups=1,
                per_group=len(workers),
                prefix_len=64,
                sessions=0,
                output_len=4,
                concurrency=len(workers),
                seed=work.seed + 1,
                vocab=work.vocab,
            )
            await drive(client, model, warm, RoundRobin(workers).place)
            rows = []
            for policy in args.policies:
                await reset_caches(client, model, len(workers), 0.0 if args.engine == "fake" else SETTLE)
                print(f"bench-routing: {policy} ...", file=sys.stderr, flush=True)
                note = ""
                if policy == "kv":
                    # workers without KV events (the light engine) make no stream: the router waits not
                    await ensure_kv_events_stream(client.js, client.names, QueuePolicy())
                    router = Router(model, weights=args.weights, trace=True)
                    async with Client(
                        url, namespace=namespace, heartbeat_timeout=120, router=router
                    ) as routed:
                        outcomes, seconds = await drive(routed, model, work, _unplaced)
                    s = router.stats
                    reasons = ", ".join(
                        f"{k} {v}" for k, v in sorted(s.reasons.items(), key=lambda kv: -kv[1])
                    )
                    note = (
                        f"router: {s.directed}/{s.decisions} jobs directed ({reasons}); expected cache hits "
                        f"{s.expected_cached_tokens:,} tokens; decision p50 {s.percentile(0.5):.0f} us"
                    )
                elif policy == "shared":
                    outcomes, seconds = await drive(client, model, work, _unplaced)
                elif policy == "round-robin":
                    outcomes, seconds = await drive(client, model, work, RoundRobin(workers).place)
                else:
                    outcomes, seconds = await drive(
                        client, model, work, Oracle(workers, work.weights()).place
                    )
                row = summarize(policy, outcomes, seconds, note)
                rows.append(row)
                print(table([row]), file=sys.stderr, flush=True)
    return rows


async def _main(
    args: argparse.Namespace, work: PrefixWorkload, opts: EngineOptions, log_dir: Path
) -> list[Row]:
    if args.nats:
        return await run_policies(args, work, opts, args.nats, log_dir)
    from ..natsserver import NatsServer

    with NatsServer(log_dir / "nats") as server:
        return await run_policies(args, work, opts, server.url, log_dir)


def kv_cache_bytes(work: PrefixWorkload, bytes_per_token: int, share: float) -> int:
    """One worker's KV cache: `share` of the workload's distinct prompt tokens, and room for at
    least four of its longest requests (vLLM refuses a cache smaller than one)."""
    tokens = max(int(work.distinct_tokens * share), 4 * (work.longest_prompt + work.output_len))
    return tokens * bytes_per_token


def cmd_bench_routing(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from .. import tinymodel

    work = PrefixWorkload(
        groups=args.groups,
        per_group=args.per_group,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        sessions=args.sessions,
        turns=args.turns,
        turn_len=args.turn_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        seed=args.seed,
        vocab=FAKE_VOCAB if args.engine == "fake" else tinymodel.VOCAB_SIZE,
    )
    need = work.longest_prompt + work.output_len
    if args.engine == "fake":
        model, served, per_token = "fake", "fake", 2048
        about = "the light test engine: no prefix cache, nothing is ever cached"
    elif args.model is None:
        positions = max(2048, 1 << (need - 1).bit_length())
        shape = tinymodel.Shape(layers=args.layers, hidden=args.hidden, max_positions=positions)
        model, served = str(tinymodel.ensure(shape=shape)), args.served_model_name or "bench-routing"
        per_token = shape.kv_bytes_per_token
        about = f"model built by the tiny model's recipe: {shape.layers} layers, hidden {shape.hidden}"
    else:
        model, served = args.model, args.served_model_name
        per_token = args.kv_bytes_per_token
        about = f"model `{args.model}`"
    cache = args.kv_cache_bytes or kv_cache_bytes(work, per_token, args.cache_share)
    opts = EngineOptions(
        model=model,
        served_model_name=served,
        max_model_len=need,
        dtype="float32",
        kv_cache_bytes=cache,
        max_num_seqs=args.slots,
        enforce_eager=True,
        kv_events=True,
    )
    caches = (
        ""
        if args.engine == "fake"
        else f", a {cache / 2**20:.0f} MiB KV cache each: {cache // per_token:,} tokens, "
        f"{cache / per_token / work.distinct_tokens:.0%} of the workload's {work.distinct_tokens:,} "
        "distinct prompt tokens"
    )
    setup = (
        f"{args.workers} workers ({about}; {args.slots} slots{caches}), every worker's prefix cache "
        "reset before each policy."
    )
    log_dir = Path(tempfile.mkdtemp(prefix="jetllm-bench-routing-"))
    rows = run(_main, args, work, opts, log_dir)
    text = report(work, setup, rows, command_line("bench-routing"))
    publish(
        text, log_dir, write=args.write, marks=section_marks(args.section), json_path=args.json, rows=rows
    )
    return 1 if any(r.errors for r in rows) else 0


def register(sub: argparse._SubParsersAction) -> None:
    from ..router.cost import Weights

    p = sub.add_parser(
        "bench-routing",
        help="KV-aware routing vs the shared queue, round-robin and an oracle, on a shared-prefix workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=3, help="vLLM workers (KV events on)")
    p.add_argument(
        "--engine",
        choices=("vllm", "fake"),
        default="vllm",
        help="fake: the light test engine of a source checkout, which caches nothing (a smoke test)",
    )
    p.add_argument(
        "--policies",
        type=choices("--policies", POLICIES),
        default=list(POLICIES),
        help="comma separated, run in this order: shared, round-robin, kv, oracle",
    )
    p.add_argument("--groups", type=int, default=6, help="groups of requests sharing a prefix")
    p.add_argument("--per-group", type=int, default=16, help="requests per group")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of a shared prefix")
    p.add_argument("--suffix-len", type=int, default=32, help="tokens of a group request after its prefix")
    p.add_argument("--sessions", type=int, default=3, help="multi-turn sessions")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--turn-len", type=int, default=32, help="new tokens per session turn")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer (greedy, ignore_eos)")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (the same for every policy)")
    p.add_argument("--slots", type=int, default=8, help="slots per worker (and the engine's max_num_seqs)")
    p.add_argument("--layers", type=int, default=6, help="layers of the built model")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the built model (64 per head)")
    p.add_argument(
        "--cache-share",
        type=float,
        default=0.5,
        help="one worker's KV cache as a share of the workload's distinct prompt tokens",
    )
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="one worker's KV cache (overrides --cache-share)"
    )
    p.add_argument(
        "--model", default=None, help="another model (default: one built by the tiny model's recipe)"
    )
    p.add_argument("--served-model-name", default=None, help="with --model: its name on the wire")
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131072,
        help="with --model: its KV bytes per token, to size the cache",
    )
    w = Weights()
    p.add_argument(
        "--w-queue", type=float, default=w.queue, help="the router's load weight (docs/routing.md)"
    )
    p.add_argument("--w-kv", type=float, default=w.kv, help="the router's KV-usage weight")
    p.add_argument("--tie", type=float, default=w.tie, help="the router's tie margin")
    p.add_argument("--nats", default=None, help="use this NATS server instead of an embedded one")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--write", default=None, help="replace the figures section of this markdown file")
    p.add_argument("--section", default="bench-routing", help="which marked section --write replaces")

    def main(a: argparse.Namespace) -> int:
        a.weights = Weights(queue=a.w_queue, kv=a.w_kv, tie=a.tie)
        return cmd_bench_routing(a)

    p.set_defaults(func=main)
