"""What a `jetllm bench` report says: each target's medians over its rounds, their ratios against
the targets' goals, the ratios round by round, and where jetllm's first token spends its time."""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import statistics
from collections.abc import Iterable

from ..workers.engine import EngineOptions
from .targets import DIRECT, GATEWAY, JETLLM, OPENAI
from .workload import Summary, Workload


def table(rows: list[Summary]) -> str:
    head = "| target | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |\n|---|---:|---:|---:|---:|---:|---:|\n"
    body = "".join(
        f"| {r.target} | {r.tokens_per_s:,.0f} | {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | "
        f"{r.itl_p50_ms:.2f} | {r.itl_p99_ms:.2f} | {r.errors} |\n"
        for r in rows
    )
    return head + body


def ttft_breakdown(j: Summary, direct_ttft_ms: float) -> str:
    """A first token's way through jetllm, hop by hop, from the trace records and the producer's
    clock (one host: the same wall clock); the p50 of each hop, so they need not add up exactly."""
    hops = []
    if j.publish_p50_ms is not None:
        hops.append(f"{j.publish_p50_ms:.1f} ms from the producer's call to JetStream storing the job")
    hops.append(f"{j.queued_p50_ms:.1f} ms from storing it to a worker pulling it")
    of = []
    if j.worker_wait_p50_ms is not None:
        of.append(f"{j.worker_wait_p50_ms:.1f} ms until the job's task ran")
    if j.worker_accept_p50_ms is not None:
        of.append(f"{j.worker_accept_p50_ms:.1f} ms to its `accepted` frame")
    accept = f", of which {' and '.join(of)}" if of else ""
    hops.append(
        f"{j.worker_ttft_p50_ms:.1f} ms from the pull to the first token frame sent "
        f"(direct TTFT: {direct_ttft_ms:.1f} ms){accept}"
    )
    if j.frame_back_p50_ms is not None:
        hops.append(
            f"{j.frame_back_p50_ms:.1f} ms from the worker sending that frame to the producer reading it"
        )
    return "- where jetllm's TTFT goes (p50 of each hop, from the workers' trace records): " + ", ".join(hops)


def ratios(rows: list[Summary]) -> str:
    by = {r.target: r for r in rows}
    d, j, o, g = by.get(DIRECT), by.get(JETLLM), by.get(OPENAI), by.get(GATEWAY)
    lines = []
    if d and j:
        lines.append(
            f"- jetllm / direct throughput: **{j.tokens_per_s / d.tokens_per_s:.3f}x** (target >= 0.95x)"
        )
        lines.append(
            f"- TTFT p50 added by jetllm: **{j.ttft_p50_ms - d.ttft_p50_ms:+.1f} ms** (target <= 5 ms)"
        )
        lines.append(f"- ITL p50 added by jetllm: {j.itl_p50_ms - d.itl_p50_ms:+.2f} ms")
        if j.queued_p50_ms is not None and j.worker_ttft_p50_ms is not None:
            lines.append(ttft_breakdown(j, d.ttft_p50_ms))
    if j and o:
        lines.append(
            f"- jetllm / vLLM OpenAI server throughput: **{j.tokens_per_s / o.tokens_per_s:.3f}x** (target >= 1x)"
        )
        lines.append(f"- TTFT p50 jetllm vs OpenAI server: {j.ttft_p50_ms - o.ttft_p50_ms:+.1f} ms")
    if g and o:
        lines.append(
            f"- jetllm gateway / vLLM OpenAI server throughput: **{g.tokens_per_s / o.tokens_per_s:.3f}x** "
            "(target >= 1x)"
        )
        lines.append(
            f"- TTFT p50 jetllm gateway vs OpenAI server: **{g.ttft_p50_ms - o.ttft_p50_ms:+.1f} ms** "
            "(target <= 0)"
        )
    return "\n".join(lines)


PAIRS = (
    (JETLLM, DIRECT, "jetllm / direct"),
    (JETLLM, OPENAI, "jetllm / vLLM OpenAI server"),
    (GATEWAY, OPENAI, "jetllm gateway / vLLM OpenAI server"),
)


def round_ratios(rounds: list[list[Summary]]) -> str:
    """Throughput ratios round by round. The targets of one round run back to back, so their ratio
    is spared most of the drift between rounds (the box's speed moves by a quarter within minutes)
    that a ratio of each target's median keeps."""
    by = {runs[0].target: runs for runs in rounds if runs}
    lines = []
    for num, den, label in PAIRS:
        if num in by and den in by and len(by[num]) > 1:
            per = [a.tokens_per_s / b.tokens_per_s for a, b in zip(by[num], by[den], strict=False)]
            lines.append(
                f"- {label} throughput round by round: {', '.join(f'{r:.3f}x' for r in per)} "
                f"(median {statistics.median(per):.3f}x)"
            )
    return "\n".join(lines)


def measured_on() -> str:
    """When and on what a benchmark ran: the first line of every report written to the docs."""
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"Measured {when} on {os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}."


def report(
    work: Workload, opts: EngineOptions, rounds: list[list[Summary]], command: str, box: str = ""
) -> str:
    """`rounds`: each target's rounds, in the order the targets were given; `box`: BoxWatch.line()."""
    rows = [combine(r) for r in rounds]
    per_round = round_ratios(rounds)
    return (
        f"{measured_on()}\n\n"
        + (f"{box}\n\n" if box else "")
        + f"Workload: {work.requests} requests, {work.concurrency} concurrent, {work.prompt_len}-token prompts, "
        f"{work.output_len} output tokens each (greedy, ignore_eos), after {work.warmup} warm-up requests; "
        f"model `{opts.name}`, engine arguments identical for all targets "
        f"(max_model_len={opts.max_model_len}, dtype={opts.dtype or 'auto'}, max_num_seqs={opts.max_num_seqs}, "
        f"block_size={opts.block_size or 'default'}, enforce_eager={opts.enforce_eager}).\n\n"
        f"Command: `{command}`\n\n"
        + table(rows)
        + "\n"
        + ratios(rows)
        + "\n\n"
        + (per_round + "\n" if per_round else "")
        + "".join(f"- {r.target}: {r.note}\n" for r in rows if r.note)
    )


def combine(runs: list[Summary]) -> Summary:
    """The median of each figure over the rounds of one target."""

    def med(attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs)

    first = runs[0]
    return Summary(
        target=first.target,
        requests=first.requests,
        output_tokens=first.output_tokens,
        seconds=med("seconds"),
        tokens_per_s=med("tokens_per_s"),
        ttft_p50_ms=med("ttft_p50_ms"),
        ttft_p99_ms=med("ttft_p99_ms"),
        itl_p50_ms=med("itl_p50_ms"),
        itl_p99_ms=med("itl_p99_ms"),
        errors=sum(r.errors for r in runs),
        queued_p50_ms=_median_of(r.queued_p50_ms for r in runs),
        worker_ttft_p50_ms=_median_of(r.worker_ttft_p50_ms for r in runs),
        worker_accept_p50_ms=_median_of(r.worker_accept_p50_ms for r in runs),
        worker_wait_p50_ms=_median_of(r.worker_wait_p50_ms for r in runs),
        publish_p50_ms=_median_of(r.publish_p50_ms for r in runs),
        frame_back_p50_ms=_median_of(r.frame_back_p50_ms for r in runs),
        note=f"median of {len(runs)} rounds; tok/s per round: "
        + ", ".join(f"{r.tokens_per_s:,.0f}" for r in runs),
    )


def _median_of(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None
