"""Running the targets one after another on the same machine, and the `jetllm bench` command (what
its report says: report.py)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from ..aio import run
from ..workers.engine import EngineOptions
from .box import BoxWatch
from .report import combine, report, table
from .targets import (
    DISAGG_WORKERS,
    run_direct,
    run_gateway,
    run_jetllm,
    run_openai,
)
from .workload import Summary, Workload

TARGETS = ("direct", "jetllm", "openai")
MORE_TARGETS = ("disagg", "gateway")
"""Not run by default: `disagg` starts two engines (a prefill and a decode worker)."""


def choices(flag: str, allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type for a comma-separated subset of `allowed`."""

    def parse(text: str) -> list[str]:
        chosen = [c for c in text.split(",") if c]
        if not chosen or any(c not in allowed for c in chosen):
            raise argparse.ArgumentTypeError(
                f"{flag} takes {', '.join(allowed)}, comma separated; got {text!r}"
            )
        return chosen

    return parse


async def _run(
    args: argparse.Namespace, work: Workload, opts: EngineOptions, log_dir: Path
) -> list[list[Summary]]:
    targets = args.targets.split(",")
    per_target: dict[str, list[Summary]] = {t: [] for t in targets}
    for round_no in range(args.rounds):
        order = targets[round_no % len(targets) :] + targets[: round_no % len(targets)]
        for target in order:
            print(f"bench: round {round_no + 1}/{args.rounds}: {target} ...", file=sys.stderr, flush=True)
            row = await _one(args, work, opts, log_dir, target)
            per_target[target].append(row)
            print(table([row]), file=sys.stderr, flush=True)
    return [per_target[t] for t in targets]


async def _one(
    args: argparse.Namespace, work: Workload, opts: EngineOptions, log_dir: Path, target: str
) -> Summary:
    from ..natsserver import NatsServer

    if target == "direct":
        return await run_direct(opts, work)
    if target == "jetllm":
        if args.nats:
            return await run_jetllm(opts, work, args.nats, log_dir, _vocab(opts))
        with NatsServer(log_dir / f"nats-{uuid.uuid4().hex[:6]}") as server:
            return await run_jetllm(opts, work, server.url, log_dir, _vocab(opts))
    if target == "openai":
        return await run_openai(opts, work, log_dir, _vocab(opts))
    if target == "gateway":
        if args.nats:
            return await run_gateway(opts, work, args.nats, log_dir, _vocab(opts))
        with NatsServer(log_dir / f"nats-{uuid.uuid4().hex[:6]}") as server:
            return await run_gateway(opts, work, server.url, log_dir, _vocab(opts))
    if target == "disagg":
        label = "jetllm, prefill + decode workers"
        with NatsServer(log_dir / f"nats-{uuid.uuid4().hex[:6]}") as server:
            url = args.nats or server.url
            return await run_jetllm(opts, work, url, log_dir, _vocab(opts), DISAGG_WORKERS, label)
    raise SystemExit(f"unknown target {target!r}; choose from {', '.join(TARGETS + MORE_TARGETS)}")


def _vocab(opts: EngineOptions) -> int:
    import json

    cfg = Path(opts.model) / "config.json"
    if cfg.is_file():
        return int(json.loads(cfg.read_text()).get("vocab_size", 500))
    return 500


def cmd_bench(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from .. import tinymodel
    from ..cli.common import TINY_MODEL_NAME, parse_kv

    model, served = args.model, args.served_model_name
    if model is None:
        model, served = str(tinymodel.ensure()), served or TINY_MODEL_NAME
    opts = EngineOptions(
        model=model,
        served_model_name=served,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        kv_events=args.kv_events,
        extra=parse_kv(args.engine_arg),
    )
    if opts.dtype is None:
        from vllm.platforms import current_platform

        opts = msgspec.structs.replace(opts, dtype="float32" if current_platform.is_cpu() else "auto")
    work = Workload(
        requests=args.requests,
        concurrency=args.concurrency,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        warmup=args.warmup,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="jetllm-bench-"))
    box = BoxWatch.start()
    rounds = run(_run, args, work, opts, log_dir)
    rows = [combine(r) for r in rounds]
    text = report(work, opts, rounds, command_line("bench"), box.line())
    publish(
        text, log_dir, write=args.write, marks=section_marks(args.section), json_path=args.json, rows=rows
    )
    return 0


MARKS = ("<!-- bench:begin -->", "<!-- bench:end -->")


def section_marks(name: str) -> tuple[str, str]:
    if not name.replace("-", "").isalnum():
        raise SystemExit(f"--section {name!r}: letters, digits and dashes only")
    return (f"<!-- {name}:begin -->", f"<!-- {name}:end -->")


def write_section(path: Path, text: str, marks: tuple[str, str] = MARKS) -> None:
    """Replace the marked section of a markdown file with new figures, keeping the prose around it."""
    begin, end = marks
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin not in old:
        old += f"\n{begin}\n{end}\n"
    head, _, rest = old.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}{end}{tail}")


def command_line(name: str) -> str:
    """How the running benchmark was invoked, as its report quotes it."""
    return f"jetllm {name} {' '.join(sys.argv[2:])}".strip()


def publish(
    text: str,
    log_dir: Path | None,
    *,
    write: str | None,
    marks: tuple[str, str],
    json_path: str | None = None,
    rows: object = None,
) -> None:
    """Every benchmark's ending: the report printed, and written where its flags say."""
    print("\n" + text)
    if json_path:
        Path(json_path).write_bytes(msgspec.json.encode(rows))
    if write:
        write_section(Path(write), text, marks)
    if log_dir is not None:
        print(f"(logs in {log_dir})", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="throughput and latency: direct AsyncLLM vs jetllm vs vLLM's HTTP server",
        description="Run one workload against AsyncLLM called directly, through jetllm (embedded "
        "NATS + a worker process), and vLLM's OpenAI server, one after another, with the same "
        "engine arguments; report output tokens/s, TTFT and inter-token latency.",
    )
    p.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help="comma separated: direct,jetllm,openai (default), disagg (a prefill and a decode worker) "
        "and gateway (a worker behind `jetllm gateway`, over HTTP as the openai target)",
    )
    p.add_argument("--requests", type=int, default=256, help="measured requests per target and round")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (closed loop)")
    p.add_argument(
        "--prompt-len", type=int, default=30, help="tokens per prompt (random ids, distinct prompts)"
    )
    p.add_argument(
        "--output-len", type=int, default=128, help="generated tokens per request (greedy, ignore_eos)"
    )
    p.add_argument("--warmup", type=int, default=32, help="requests before measuring, per target and round")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repeat every target this many times (rotating the order) and report medians",
    )
    p.add_argument("--model", default=None, help="default: the tiny model")
    p.add_argument("--served-model-name", default=None, help="name of the model on the wire")
    p.add_argument("--max-model-len", type=int, default=1024, help="engine argument, same for every target")
    p.add_argument("--dtype", default=None, help="engine argument (default: float32 on CPU)")
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="engine argument")
    p.add_argument("--block-size", type=int, default=None, help="engine argument (default: vLLM's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine argument; also the worker's slots")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other engine argument, for every target (repeatable)",
    )
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="KV-cache events on for the direct and jetllm targets (default: off, as in the published "
        "figures)",
    )
    p.add_argument("--nats", default=None, help="use this NATS server instead of an embedded one")
    p.add_argument("--json", default=None, help="also write the summaries as JSON here")
    p.add_argument("--write", default=None, help="replace the figures section of this markdown file")
    p.add_argument(
        "--section",
        default="bench",
        help="which section --write replaces: the one between <!-- NAME:begin --> and <!-- NAME:end -->",
    )
    p.set_defaults(func=cmd_bench)
