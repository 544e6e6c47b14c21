"""What `jetllm bench-routing` reports: per policy a row (TTFT, throughput, cache hits, the
spread over workers) from what each request's producer saw, and the ratios the issue's targets
name. Pure: the run itself is bench/routing.py."""

from __future__ import annotations

from collections import Counter

import msgspec

from .prefixload import PrefixWorkload
from .report import measured_on
from .workload import percentile

LABELS = {
    "shared": "shared queue",
    "round-robin": "round-robin (directed)",
    "kv": "KV-aware router",
    "oracle": "oracle (knows every cache)",
}


class Outcome(msgspec.Struct, kw_only=True):
    """One request as the producer saw it; seconds from its submission."""

    key: str
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str = ""
    error: str | None = None


class Row(msgspec.Struct, kw_only=True):
    policy: str
    requests: int
    errors: int
    seconds: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    prompt_tokens: int
    cached_tokens: int
    per_worker: list[int]
    """Requests each worker ran, most first."""
    hits: int = 0
    """Requests that found at least half their prompt cached."""
    hit_ttft_p50_ms: float | None = None
    miss_ttft_p50_ms: float | None = None
    """TTFT p50 of the requests that found less than half their prompt cached."""
    note: str = ""


def summarize(policy: str, outcomes: list[Outcome], seconds: float, note: str = "") -> Row:
    ok = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    tokens = sum(o.output_tokens for o in ok)
    hit = [o.ttft for o in ok if o.ttft is not None and 2 * o.cached_tokens >= o.prompt_tokens]
    miss = [o.ttft for o in ok if o.ttft is not None and 2 * o.cached_tokens < o.prompt_tokens]
    return Row(
        policy=policy,
        requests=len(outcomes),
        errors=len(outcomes) - len(ok),
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p90_ms=percentile(ttfts, 90) * 1000,
        prompt_tokens=sum(o.prompt_tokens for o in ok),
        cached_tokens=sum(o.cached_tokens for o in ok),
        per_worker=sorted(Counter(o.worker for o in ok).values(), reverse=True),
        hits=len(hit),
        hit_ttft_p50_ms=percentile(hit, 50) * 1000 if hit else None,
        miss_ttft_p50_ms=percentile(miss, 50) * 1000 if miss else None,
        note=note,
    )


def table(rows: list[Row]) -> str:
    head = (
        "| policy | TTFT p50 ms | TTFT p90 ms | output tok/s | cache-hit tokens | of prompt tokens | "
        "hits | TTFT p50 hit / miss ms | requests per worker | errors |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    )
    body = "".join(
        f"| {LABELS.get(r.policy, r.policy)} | {r.ttft_p50_ms:,.0f} | {r.ttft_p90_ms:,.0f} | "
        f"{r.tokens_per_s:,.1f} | {r.cached_tokens:,} | "
        f"{(r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0):.0%} | {r.hits}/{r.requests} | "
        f"{_ms(r.hit_ttft_p50_ms)} / {_ms(r.miss_ttft_p50_ms)} | "
        f"{'/'.join(map(str, r.per_worker))} | {r.errors} |\n"
        for r in rows
    )
    return head + body


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


class Ratios(msgspec.Struct, kw_only=True):
    """The issue's targets: each None when a policy it compares was not run."""

    p90_vs_shared: float | None = None
    """The shared queue's TTFT p90 over the router's (target >= 3)."""
    hits_vs_oracle: float | None = None
    """The router's cache-hit tokens over the oracle's (target >= 0.95)."""
    throughput_vs_shared: float | None = None
    """The router's output tokens/s over the shared queue's (target >= 1)."""
    throughput_vs_round_robin: float | None = None


def ratios(rows: list[Row]) -> Ratios:
    by = {r.policy: r for r in rows}
    kv, shared, oracle, rr = by.get("kv"), by.get("shared"), by.get("oracle"), by.get("round-robin")

    def div(a: float, b: float) -> float | None:
        return a / b if b else None

    out = Ratios()
    if kv and shared:
        out.p90_vs_shared = div(shared.ttft_p90_ms, kv.ttft_p90_ms)
        out.throughput_vs_shared = div(kv.tokens_per_s, shared.tokens_per_s)
    if kv and oracle:
        out.hits_vs_oracle = div(kv.cached_tokens, oracle.cached_tokens)
    if kv and rr:
        out.throughput_vs_round_robin = div(kv.tokens_per_s, rr.tokens_per_s)
    return out


def ratio_lines(r: Ratios) -> str:
    def met(value: float | None, target: float) -> str:
        if value is None:
            return "not measured"
        return "met" if value >= target else "**not met**"

    lines = []
    if r.p90_vs_shared is not None:
        lines.append(
            f"- TTFT p90, shared queue / KV-aware: **{r.p90_vs_shared:.2f}x** "
            f"(target >= 3x: {met(r.p90_vs_shared, 3)})"
        )
    if r.hits_vs_oracle is not None:
        lines.append(
            f"- cache-hit tokens, KV-aware / oracle: **{r.hits_vs_oracle:.1%}** "
            f"(target >= 95%: {met(r.hits_vs_oracle, 0.95)})"
        )
    if r.throughput_vs_shared is not None:
        lines.append(
            f"- throughput, KV-aware / shared queue: **{r.throughput_vs_shared:.2f}x** "
            f"(target >= 1x: {met(r.throughput_vs_shared, 1)})"
        )
    if r.throughput_vs_round_robin is not None:
        lines.append(f"- throughput, KV-aware / round-robin: {r.throughput_vs_round_robin:.2f}x")
    return "\n".join(lines)


def report(work: PrefixWorkload, setup: str, rows: list[Row], command: str) -> str:
    return (
        f"{measured_on()}\n\n"
        f"Workload ({work.requests} requests, {work.concurrency} in flight, greedy, {work.output_len} "
        f"output tokens each, seed {work.seed}): {work.groups} groups of {work.per_group} requests sharing "
        f"a {work.prefix_len}-token prefix (then {work.suffix_len} tokens of their own), and "
        f"{work.sessions} sessions of {work.turns} turns (a {work.prefix_len}-token first prompt; each "
        f"next turn is the previous prompt, its answer and {work.turn_len} new tokens). {setup}\n\n"
        f"Command: `{command}`\n\n"
        + table(rows)
        + "\n"
        + ratio_lines(ratios(rows))
        + "\n\n"
        + "".join(f"- {LABELS.get(r.policy, r.policy)}: {r.note}\n" for r in rows if r.note)
    )
