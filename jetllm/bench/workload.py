"""One benchmark workload, its per-request timings, and the summary figures."""

from __future__ import annotations

import random
import statistics

import msgspec


class Workload(msgspec.Struct, kw_only=True):
    requests: int = 256
    concurrency: int = 32
    prompt_len: int = 30
    output_len: int = 128
    warmup: int = 32
    seed: int = 0

    def prompts(self, vocab_size: int, count: int | None = None, offset: int = 0) -> list[list[int]]:
        """Distinct random token-id prompts (ids 4.. skip the tiny model's special tokens)."""
        rng = random.Random(self.seed + offset)
        n = self.requests if count is None else count
        return [[rng.randrange(4, vocab_size) for _ in range(self.prompt_len)] for _ in range(n)]


class Timing(msgspec.Struct, kw_only=True):
    """Seconds from submission; `chunks` holds (arrival, tokens) per streamed chunk."""

    ttft: float
    e2e: float
    tokens: int
    itl: list[float]


class Summary(msgspec.Struct, kw_only=True):
    target: str
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    errors: int = 0
    note: str = ""
    queued_p50_ms: float | None = None
    """jetllm only, from the workers' trace records: JetStream stored the job -> a worker pulled it."""
    worker_ttft_p50_ms: float | None = None
    """jetllm only: a worker pulled the job -> it sent the first token frame."""
    worker_accept_p50_ms: float | None = None
    """jetllm only: a worker pulled the job -> it sent `accepted` (its request log read and its claim
    written; a first token the engine made sooner waits for it)."""
    worker_wait_p50_ms: float | None = None
    """jetllm only: a worker pulled the job -> the job's task first ran (the worker's busy loop)."""
    publish_p50_ms: float | None = None
    """jetllm only: the producer called `generate` -> JetStream stored the job."""
    frame_back_p50_ms: float | None = None
    """jetllm only: the worker sent the first token frame -> the producer read it."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 else max(values)


def summarize(target: str, timings: list[Timing], seconds: float, errors: int = 0, note: str = "") -> Summary:
    tokens = sum(t.tokens for t in timings)
    ttfts = [t.ttft for t in timings]
    itls = [x for t in timings for x in t.itl]
    return Summary(
        target=target,
        requests=len(timings),
        output_tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p99_ms=percentile(ttfts, 99) * 1000,
        itl_p50_ms=percentile(itls, 50) * 1000,
        itl_p99_ms=percentile(itls, 99) * 1000,
        errors=errors,
        note=note,
    )


class Recorder:
    """Collects one request's chunk arrivals."""

    __slots__ = ("start", "first", "last", "tokens", "itl")

    def __init__(self, start: float) -> None:
        self.start = start
        self.first: float | None = None
        self.last = start
        self.tokens = 0
        self.itl: list[float] = []

    def chunk(self, now: float, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.tokens += n_tokens

    def done(self, now: float) -> Timing:
        return Timing(
            ttft=(self.first or now) - self.start, e2e=now - self.start, tokens=self.tokens, itl=self.itl
        )
