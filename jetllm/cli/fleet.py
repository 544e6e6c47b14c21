"""`jetllm status|health|ctl|trace`: the fleet as the registry sees it, and control verbs sent to it."""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import nats.errors

from ..aio import run
from ..producer.fleet import ask
from ..producer.registry import instances, watch
from ..producer.results import result_quietly
from ..producer.traces import trace_records
from ..router.trace import route_lines
from ..schemas import (
    ControlFailed,
    HealthCheck,
    HealthReport,
    InstanceRecord,
    Result,
    SleepRequest,
    TasksReport,
)
from ..subjects import codec
from ..subjects.connection import connect
from ..subjects.names import Names
from .common import add_nats, nats_url
from .probe import probe


def _age(ts: float) -> str:
    s = max(0, int(time.time() - ts))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _cached(r: InstanceRecord) -> str:
    return "-" if r.cached_blocks is None else str(r.cached_blocks)


def _table(records: list[InstanceRecord]) -> str:
    head = (
        f"{'instance':34} {'model':16} {'role':9} {'state':9} {'ready':5} {'jobs':>9} {'blocks':>7} "
        f"{'cached':>7} {'up':>7}  adapters"
    )
    lines = [head]
    for r in records:
        lines.append(
            f"{r.instance[:34]:34} {r.model[:16]:16} {r.role:9} {r.state:9} {'yes' if r.ready else 'no':5} "
            f"{f'{r.in_flight}/{r.slots}':>9} {r.engine.num_kv_blocks or '-':>7} {_cached(r):>7} "
            f"{_age(r.started_at):>7}  "
            f"{','.join(r.adapters) or '-'}"
        )
    if not records:
        lines.append("(no live instances)")
    return "\n".join(lines)


async def _status(args: argparse.Namespace) -> int:
    nc = await connect(nats_url(args))
    names = Names(args.namespace)
    js = nc.jetstream(timeout=5)
    try:
        if not args.watch:
            records = await instances(js, names, model=args.model)
            if args.json:
                for r in records:
                    print(msgspec.json.encode(r).decode())
            else:
                print(_table(records))
            return 0
        shown = None
        async for current in watch(js, names):
            records = sorted(
                (r for r in current.values() if args.model in (None, r.model)), key=lambda r: r.instance
            )
            text = _table(records)
            if text != shown:
                if args.json:
                    print(json.dumps([msgspec.to_builtins(r) for r in records]), flush=True)
                else:
                    sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n")
                    print(time.strftime("%H:%M:%S"), text, sep="\n", flush=True)
                shown = text
    finally:
        await nc.close()
    return 0


def _target(args: argparse.Namespace) -> dict:
    if args.instance:
        return {"instance": args.instance}
    if args.model:
        return {"model": args.model}
    raise SystemExit("name --instance or --model")


async def _ask(nc, names: Names, verb: str, body: bytes, timeout: float, **target: str) -> list:
    """The replies, or none with a one-line reason (an unknown instance, no answer in time)."""
    try:
        return await ask(nc, names, verb, body, timeout=timeout, **target)
    except (LookupError, nats.errors.TimeoutError) as exc:
        print(str(exc) or f"no answer within {timeout:.0f}s", file=sys.stderr)
        return []


async def _health(args: argparse.Namespace) -> int:
    names = Names(args.namespace)
    check = HealthCheck(canary=not args.no_canary, stall_timeout=args.stall_timeout)
    if args.local:
        return await probe(
            nats_url(args), names, check, liveness=args.liveness, timeout=args.timeout, json=args.json
        )
    if args.liveness:
        raise SystemExit("--liveness goes with --local")
    nc = await connect(nats_url(args))
    try:
        targets = (
            [{"instance": args.instance}]
            if args.instance
            else (
                [{"model": args.model}]
                if args.model
                else [{"model": m} for m in sorted({r.model for r in await instances(nc.jetstream(), names)})]
            )
        )
        body = codec.encode(check)
        replies = []
        for t in targets:
            replies += await _ask(nc, names, "health", body, args.timeout, **t)
    finally:
        await nc.close()
    bad = 0
    for r in replies:
        if args.json:
            print(msgspec.json.encode(r).decode())
        elif isinstance(r, HealthReport):
            canary = (
                "-"
                if r.canary_ok is None
                else (
                    f"{'ok' if r.canary_ok else 'FAILED'} {r.canary_tokens} tok {r.canary_latency_ms:.0f} ms"
                )
            )
            print(
                f"{r.instance:34} {'healthy' if r.healthy else 'UNHEALTHY':9} engine={'up' if r.engine_alive else 'DEAD'} "
                f"state={r.state} canary={canary}" + (f" last_error={r.last_error}" if r.last_error else "")
            )
        else:
            print(f"{r.instance:34} failed: {getattr(r, 'message', r)}")
        bad += not (isinstance(r, HealthReport) and r.healthy)
    if not replies:
        print("no instance answered", file=sys.stderr)
        return 1
    return 1 if bad else 0


async def _ask_target(args: argparse.Namespace, verb: str, body: bytes = b"") -> list:
    """`verb` to the instance or model the flags name, on a connection of its own."""
    nc = await connect(nats_url(args))
    try:
        return await _ask(nc, Names(args.namespace), verb, body, args.timeout, **_target(args))
    finally:
        await nc.close()


async def _ctl(args: argparse.Namespace) -> int:
    body = codec.encode(SleepRequest(level=args.level)) if args.verb == "sleep" else b""
    replies = await _ask_target(args, args.verb, body)
    for r in replies:
        print(msgspec.json.encode(r).decode())
    return 1 if not replies or any(isinstance(r, ControlFailed) for r in replies) else 0


async def _tasks(args: argparse.Namespace) -> int:
    replies = await _ask_target(args, "tasks")
    for r in replies:
        if args.json:
            print(msgspec.json.encode(r).decode())
        elif isinstance(r, TasksReport):
            print(f"{r.instance}: {len(r.tasks)} tasks, each with what it awaits (outermost first)")
            for t in r.tasks:
                print(f"  {t.name}: " + " > ".join(t.awaits))
        else:
            print(f"{r.instance:34} failed: {getattr(r, 'message', r)}")
    return 0 if replies and all(isinstance(r, TasksReport) for r in replies) else 1


async def _trace(args: argparse.Namespace) -> int:
    nc = await connect(nats_url(args))
    names = Names(args.namespace)
    try:
        js = nc.jetstream(timeout=5)
        records = await trace_records(js, names, args.request_id)
        ended = None if records else await result_quietly(js, names, args.request_id)
    finally:
        await nc.close()
    if not records:
        if ended is None:
            print(
                f"no trace records for {args.request_id!r} (unknown, or older than the results retention)",
                file=sys.stderr,
            )
            return 1
        print(
            f"no trace records for {args.request_id!r} (a batch line that travelled in a shard keeps none "
            f"of its own, and a record can be lost); its result: {_ended(ended)}",
            file=sys.stderr,
        )
        return 1 if args.json else 0  # --json prints trace records, and there are none
    if args.json:
        for r in records:
            print(msgspec.json.encode(r).decode())
        return 0
    t0 = records[0].queued_at
    print(f"request {args.request_id}  trace {records[0].trace_id}")
    print(f"  +{0:8.1f} ms  queued (JetStream stored the job)")
    for r in records:
        ms = lambda t: f"+{(t - t0) * 1000:8.1f} ms"  # noqa: E731
        if r.route is not None:
            head, *rest = route_lines(r)
            print(f"{ms(r.ended_at)}  {head}")
            for line in rest:
                print(f"{'':13}  {line}")
            continue
        print(
            f"{ms(r.pulled_at)}  attempt {r.attempt} pulled by {r.instance} (span {r.span_id})"
            f" from the {_queue(r.queue)}"
        )
        if r.accepted_at:
            resumed = f", resuming after {r.resumed_tokens} tokens" if r.resumed_tokens else ""
            print(f"{ms(r.accepted_at)}  accepted{resumed}")
        if r.prefill:
            print(f"{'':13}  prompt prefilled {r.prefill}")
        if r.first_token_at:
            print(f"{ms(r.first_token_at)}  first token")
        print(f"{ms(r.ended_at)}  {r.outcome}: {r.completion_tokens} tokens in {r.frames} frames")
    return 0


def _ended(r: Result) -> str:
    by = f"worker {r.worker or '?'}, attempt {r.attempt}, {r.migrations} migrations"
    if r.error is not None:
        return f"{r.error.code.value} ({by}): {r.error.message}"
    if r.final is None:
        return f"no outcome ({by})"
    return f"completed by {by}: {r.final.usage.completion_tokens} tokens"


def _queue(queue: str) -> str:
    if queue == "directed":
        return "directed queue (addressed to it)"
    if queue.startswith("moved from "):
        return f"shared queue (directed to {queue[len('moved from ') :]}, moved)"
    return "shared queue"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="one request's path through the fleet, hop by hop, with timings")
    add_nats(p)
    p.add_argument("request_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_trace, a))

    p = sub.add_parser("status", help="live instances from the registry (a table; --watch keeps it live)")
    add_nats(p)
    p.add_argument("--model", default=None, help="only instances serving this model")
    p.add_argument("--watch", action="store_true", help="redraw on every change until Ctrl-C")
    p.add_argument("--json", action="store_true", help="one JSON record per line")
    p.set_defaults(func=lambda a: run(_status, a))

    p = sub.add_parser("health", help="ask instances for engine liveness and a canary generation")
    add_nats(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--instance", default=None)
    which.add_argument("--model", default=None, help="every instance of this model (default: every model)")
    which.add_argument(
        "--local",
        action="store_true",
        help="the workers of this host (a container's exec probe): exit 0 when each is healthy and serving",
    )
    p.add_argument(
        "--liveness",
        action="store_true",
        help="with --local: pass while the engine is alive, in any state, and when NATS cannot be asked "
        "(the probe then knows nothing about the worker)",
    )
    p.add_argument("--no-canary", action="store_true", help="engine liveness only")
    p.add_argument(
        "--stall-timeout",
        type=_stall_timeout,
        default=5.0,
        help="fail the canary after this long without a token (seconds, at most 600)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds each instance gets to answer")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_health, a))

    p = sub.add_parser(
        "tasks",
        help="where each task of a worker waits (as SIGUSR1 logs it): for a request that will not end",
    )
    add_nats(p)
    p.add_argument("--instance", default=None)
    p.add_argument("--model", default=None, help="every instance of the model")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: run(_tasks, a))

    p = sub.add_parser(
        "ctl", help="engine control: reset-prefix-cache, sleep, wake (one instance or a model)"
    )
    add_nats(p)
    p.add_argument("verb", choices=["reset-prefix-cache", "sleep", "wake"])
    p.add_argument("--instance", default=None)
    p.add_argument("--model", default=None)
    p.add_argument(
        "--level",
        type=int,
        default=1,
        help="sleep level; GPU only, both drop the KV cache: 1 moves weights to CPU memory, 2 discards them",
    )
    p.add_argument("--timeout", type=float, default=60.0)
    p.set_defaults(func=lambda a: run(_ctl, a))


def _stall_timeout(text: str) -> float:
    """Checked against HealthCheck's own bounds: a probe must not ask what every worker refuses
    (a liveness probe would then fail them all)."""
    try:
        return msgspec.convert({"stall_timeout": float(text)}, HealthCheck).stall_timeout
    except (ValueError, msgspec.ValidationError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
