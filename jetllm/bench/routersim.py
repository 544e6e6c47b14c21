"""`jetllm bench-router-sim`: the router's index and decision at fleet scale, without a fleet.

Builds the index of `workers` instances holding `blocks` blocks each (a share of them from common
system prompts, the rest their own conversations), then runs decisions while absorbing KV events
at a set rate (each batch stores a conversation's new blocks and evicts as many old ones, as a full
cache does). Reports the decision time (prefix lookup over every instance and over the router's
pending placements, plus the cost of every candidate; the prompt's own hashing reported apart),
the events absorbed per second, and memory.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import time
from collections import deque

import psutil

from ..router.cost import Candidate, Weights, by_load, choose, shortlist
from ..router.hashing import BlockHasher
from ..router.index import BlockIndex
from ..router.pending import PendingBlocks, RecentJobs
from ..schemas import KvRemoved, KvStored

BLOCK = 16


def _lately(recent: RecentJobs, now: float, instance: str) -> float:
    return recent.of(instance, now)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _stored(hashes: list[int], parent: int | None) -> KvStored:
    return KvStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=BLOCK)


def simulate(
    workers: int,
    blocks: int,
    *,
    prefixes: int = 200,
    prefix_blocks: int = 32,
    prefixes_per_worker: int = 20,
    batch_blocks: int = 16,
    event_rate: float = 2000.0,
    decision_rate: float = 1000.0,
    decisions: int = 20_000,
    seed: int = 0,
) -> dict[str, float]:
    rnd = random.Random(seed)
    bits = rnd.getrandbits
    shared = [[bits(64) for _ in range(prefix_blocks)] for _ in range(prefixes)]
    index = BlockIndex()
    before = _rss()
    own: list[deque[list[int]]] = []
    t0 = time.perf_counter()
    applied_blocks = 0
    for w in range(workers):
        slot = index.slot(f"worker-{w:04d}")
        held = 0
        for p in rnd.sample(range(prefixes), min(prefixes_per_worker, prefixes)):
            index.apply(slot, [_stored(shared[p], None)])
            held += prefix_blocks
        chains: deque[list[int]] = deque()
        while held < blocks:
            chain = [bits(64) for _ in range(min(batch_blocks, blocks - held))]
            index.apply(slot, [_stored(chain, None)])
            chains.append(chain)
            held += len(chain)
        applied_blocks += held
        own.append(chains)
    build_s = time.perf_counter() - t0
    memory = _rss() - before

    weights = Weights()
    loads = [(rnd.randint(0, 8), rnd.randint(0, 4), 16, rnd.random()) for _ in range(workers)]
    ranked = by_load([Candidate(f"worker-{i:04d}", 0, *loads[i]) for i in range(workers)], weights)
    position = {c.instance: i for i, c in enumerate(ranked)}
    per_decision = event_rate / decision_rate
    owed = 0.0
    pending, recent = PendingBlocks(), RecentJobs()
    decide_ns: list[int] = []
    decide_cpu_ns: list[int] = []
    churn_ns = 0
    churn_blocks = 0
    for _ in range(decisions):
        owed += per_decision
        while owed >= 1:  # one batch: a conversation's new blocks in, the oldest out
            owed -= 1
            w = rnd.randrange(workers)
            chains = own[w]
            fresh = [bits(64) for _ in range(batch_blocks)]
            old = chains.popleft() if chains else []
            chains.append(fresh)
            slot = index.slot(f"worker-{w:04d}")
            s = time.perf_counter_ns()
            index.apply(slot, [KvRemoved(block_hashes=old), _stored(fresh, None)])
            churn_ns += time.perf_counter_ns() - s
            churn_blocks += len(old) + len(fresh)
        w = rnd.randrange(workers)
        prompt_chain = shared[rnd.randrange(prefixes)] + (own[w][-1] if own[w] else [])
        prompt_tokens = len(prompt_chain) * BLOCK + 7
        s, c = time.perf_counter_ns(), time.thread_time_ns()
        now = time.monotonic()
        hits = index.overlap(prompt_chain)
        sent = pending.holder(prompt_chain, now)
        if sent is not None and sent[1] > hits.get(sent[0], 0):
            hits[sent[0]] = sent[1]
        cached = {inst: n * BLOCK for inst, n in hits.items()}
        choice = choose(
            prompt_tokens,
            shortlist(ranked, cached, position),
            weights,
            cached=cached,
            home_key=prompt_chain[0],
            recent=functools.partial(_lately, recent, now),
        )
        if choice.instance is not None:
            recent.add(choice.instance, now)
            pending.note(prompt_chain, choice.instance, now)
        decide_cpu_ns.append(time.thread_time_ns() - c)
        decide_ns.append(time.perf_counter_ns() - s)

    hasher = BlockHasher(BLOCK)
    tokens = [rnd.randrange(32000) for _ in range(2048)]
    s = time.perf_counter_ns()
    for _ in range(50):
        hasher.chain(tokens)
    hash_us = (time.perf_counter_ns() - s) / 50 / 1000
    decide_ns.sort()
    decide_cpu_ns.sort()
    churn_s = churn_ns / 1e9
    return {
        "workers": workers,
        "blocks_per_worker": blocks,
        "distinct_blocks": index.blocks,
        "build_s": build_s,
        "build_blocks_per_s": applied_blocks / build_s,
        "memory_mb": memory / 2**20,
        "decision_p50_us": decide_ns[len(decide_ns) // 2] / 1000,
        "decision_p99_us": decide_ns[int(len(decide_ns) * 0.99)] / 1000,
        "decision_cpu_p50_us": decide_cpu_ns[len(decide_cpu_ns) // 2] / 1000,
        "decision_cpu_p99_us": decide_cpu_ns[int(len(decide_cpu_ns) * 0.99)] / 1000,
        "hash_2048_tokens_us": hash_us,
        "churn_blocks_per_s": churn_blocks / churn_s if churn_s else 0.0,
        "churn_batches_per_s": (decisions * per_decision) / churn_s if churn_s else 0.0,
        "event_rate_batches_per_s": event_rate,
        "busy_fraction": (sum(decide_ns) / 1e9 / decisions * decision_rate)
        + churn_s / decisions * decision_rate,
    }


def report(r: dict[str, float]) -> str:
    return "\n".join(
        [
            f"index: {r['workers']:.0f} workers x {r['blocks_per_worker']:.0f} blocks "
            f"({r['distinct_blocks']:.0f} distinct), {r['memory_mb']:.0f} MiB, "
            f"built in {r['build_s']:.1f} s ({r['build_blocks_per_s']:.0f} blocks/s)",
            f"decision (lookup + cost of every candidate): p50 {r['decision_p50_us']:.0f} us, "
            f"p99 {r['decision_p99_us']:.0f} us wall clock (CPU time: p50 {r['decision_cpu_p50_us']:.0f} us, "
            f"p99 {r['decision_cpu_p99_us']:.0f} us); "
            f"hashing a 2,048-token prompt: {r['hash_2048_tokens_us']:.0f} us",
            f"events absorbed: {r['churn_batches_per_s']:.0f} batches/s ({r['churn_blocks_per_s']:.0f} "
            f"block events/s); at {r['event_rate_batches_per_s']:.0f} batches/s and the decision rate the "
            f"router is busy {r['busy_fraction'] * 100:.0f}% of the time",
        ]
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-router-sim",
        help="the KV-aware router's index at fleet scale: decision time, events absorbed, memory",
        description=__doc__,
    )
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=10_000, help="cached blocks per worker")
    p.add_argument("--prefixes", type=int, default=200, help="shared system prompts")
    p.add_argument("--prefix-blocks", type=int, default=32, help="blocks of a system prompt")
    p.add_argument("--event-rate", type=float, default=2000.0, help="KV-event batches per second, fleet-wide")
    p.add_argument("--decision-rate", type=float, default=1000.0, help="jobs placed per second")
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--json", action="store_true")

    def main(a: argparse.Namespace) -> int:
        import json

        r = simulate(
            a.workers,
            a.blocks,
            prefixes=a.prefixes,
            prefix_blocks=a.prefix_blocks,
            event_rate=a.event_rate,
            decision_rate=a.decision_rate,
            decisions=a.decisions,
        )
        print(json.dumps(r) if a.json else report(r))
        return 0

    p.set_defaults(func=main)
