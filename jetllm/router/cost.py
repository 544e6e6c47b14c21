"""The placement decision: pure, synchronous, table-tested (tests/test_router_cost.py).

cost(candidate) = compute * (prompt tokens it would compute)
                + queue * (running + waiting) / slots
                + kv * kv_usage

All terms are in prompt-token units: `queue` is what one full round of busy slots is worth in
tokens to compute, `kv` what a full KV cache is worth (a full cache evicts, and its next prefill
queues). The lowest cost wins; the shared queue takes the job on a tie or when the data to decide
is missing. Holders of the prompt that tie while another instance costs more are not "nothing":
the lowest id takes it. Nor is a prompt no instance holds: it goes to its home among the least
loaded (`rank`), so that its next jobs, which the router then sends after it (pending.py), find
its blocks in one place instead of each computing them on another instance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Weights:
    compute: float = 1.0
    """Per prompt token the candidate would compute (not cached)."""
    queue: float = 512.0
    """Per unit of (running + waiting) / slots."""
    kv: float = 128.0
    """Per unit of KV-cache usage (0..1)."""
    tie: float = 0.5
    """Costs closer than this are a tie (the shared queue takes the job)."""
    min_cached: int = 1
    """Fewest cached tokens on the best candidate that make the job worth directing."""


TRACED = 8
"""Candidates a decision reports (and its trace record shows)."""


class Candidate(NamedTuple):
    instance: str
    cached_tokens: int
    """Prompt tokens the engine would find cached (blocks matched x block size, capped)."""
    running: int = 0
    waiting: int = 0
    slots: int = 0
    """Requests it runs at once; 0: unknown (no load data)."""
    kv_usage: float | None = None


class Scored(NamedTuple):
    candidate: Candidate
    cost: float


@dataclass(frozen=True)
class Choice:
    instance: str | None
    """None: the shared queue."""
    why: str
    scored: list[Scored] = field(default_factory=list)
    """The TRACED cheapest candidates with their costs, cheapest first."""


def load_cost(c: Candidate, w: Weights) -> float:
    busy = (c.running + c.waiting) / c.slots if c.slots > 0 else 0.0
    return w.queue * busy + w.kv * (c.kv_usage or 0.0)


def cost(c: Candidate, prompt_tokens: int, w: Weights) -> float:
    return w.compute * max(0, prompt_tokens - c.cached_tokens) + load_cost(c, w)


def by_load(candidates: Sequence[Candidate], w: Weights) -> list[Candidate]:
    """Least loaded first: what `shortlist` takes (built once per load change, not per job)."""
    return sorted(candidates, key=lambda c: load_cost(c, w))


def shortlist(
    ranked: Sequence[Candidate], cached: Mapping[str, int], position: Mapping[str, int], keep: int = TRACED
) -> list[Candidate]:
    """The candidates `choose` needs to decide as if it saw all of `ranked` (sorted by `by_load`,
    `position` its index): every holder of a cached prefix, plus the `keep` least loaded others. Of
    the instances holding nothing the cheapest is the least loaded, so the rest cannot win or tie
    first; this keeps a decision over 1,000 instances to the few that matter. Pass `cached` to
    `choose` with them: the candidates are `ranked`'s own, with nothing cached."""
    out = [ranked[at] for at in map(position.get, cached) if at is not None]
    cold = 0
    for c in ranked:
        if cold >= keep:
            break
        if c.instance not in cached:
            out.append(c)
            cold += 1
    return out


def choose(
    prompt_tokens: int,
    candidates: Sequence[Candidate],
    w: Weights,
    *,
    cached: Mapping[str, int] | None = None,
    session: str | None = None,
    new_session: bool = False,
    home_key: int | None = None,
    recent: Callable[[str], float] | None = None,
) -> Choice:
    """Where a job with `prompt_tokens` goes. `cached`: cached tokens per instance, instead of the
    candidates' own field (the router's shortlist passes it, to build no candidate per job).

    When no candidate holds any of the prompt (no events, or a cold cache), a job of a session goes
    to `session`, the instance its session last went to, and the first job of a session
    (`new_session`) to the cheapest candidate, which it then sticks to. Any other such job with a
    `home_key` (a key of its prompt's leading blocks) goes to its home: of the least loaded
    candidates with load data, the one sent the fewest jobs lately (`recent`, rounded), then the
    one `home_key` ranks first, so the prompt's next jobs can follow it and prefixes spread."""
    if not candidates:
        return Choice(None, "no live instance")
    get = cached.get if cached is not None else None
    hits = [c.cached_tokens if get is None else get(c.instance, c.cached_tokens) for c in candidates]
    q, kv, per = w.queue, w.kv, w.compute
    costs = sorted(
        (
            per * max(0, prompt_tokens - hit)
            + (q * (c.running + c.waiting) / c.slots if c.slots > 0 else 0.0)
            + kv * (c.kv_usage or 0.0),
            i,
        )
        for i, (c, hit) in enumerate(zip(candidates, hits, strict=True))
    )
    scored = [Scored(candidates[i]._replace(cached_tokens=hits[i]), cost) for cost, i in costs[:TRACED]]
    if max(hits) < w.min_cached:
        if session is not None and any(c.instance == session for c in candidates):
            return Choice(session, "session affinity (no cached prefix anywhere)", scored)
        known = next((candidates[i].instance for _, i in costs if candidates[i].slots > 0), None)
        if (session is not None or new_session) and known is not None:
            return Choice(known, "session start: least loaded (no cached prefix anywhere)", scored)
        if home_key is not None and known is not None:
            best = costs[0][0]
            least = [candidates[i] for cost_, i in costs if cost_ - best < w.tie and candidates[i].slots > 0]
            if least:
                lately = recent or (lambda _: 0.0)
                home = min(least, key=lambda c: (round(lately(c.instance)), -rank(home_key, c.instance)))
                return Choice(
                    home.instance,
                    f"prompt's home: no cached prefix anywhere, least loaded of {len(least)} with load data",
                    scored,
                )
        return Choice(None, "no cached prefix on any instance", scored)
    first = scored[0]
    best = costs[0][0]
    tied = [i for cost_, i in costs if cost_ - best < w.tie]
    if len(tied) > 1:
        holders = [i for i in tied if hits[i] >= w.min_cached and candidates[i].slots > 0]
        if len(holders) < len(tied) or len(tied) == len(candidates):
            return Choice(
                None, f"tie between {first.candidate.instance} and {scored[1].candidate.instance}", scored
            )
        # Only holders with load data tie, and some instance costs more: the shared queue could
        # hand the job to that one. A holder takes it instead: the lowest id, as on every router.
        at = min(holders, key=lambda i: candidates[i].instance)
        c = candidates[at]._replace(cached_tokens=hits[at])
        return Choice(
            c.instance,
            f"{c.cached_tokens}/{prompt_tokens} prompt tokens cached, load {c.running}+{c.waiting}/"
            f"{c.slots}: lowest cost {best:.0f}, tied with {len(holders) - 1} other holder(s), lowest id",
            scored,
        )
    if first.candidate.slots <= 0:
        return Choice(None, f"no load data for {first.candidate.instance}", scored)
    c = first.candidate
    return Choice(
        c.instance,
        f"{c.cached_tokens}/{prompt_tokens} prompt tokens cached, "
        f"load {c.running}+{c.waiting}/{c.slots}: lowest cost {first.cost:.0f}",
        scored,
    )


def rank(key: int, instance: str) -> int:
    """Rendezvous hashing: where a key ranks an instance, the same on every router."""
    h = hashlib.blake2b(key.to_bytes(8, "big") + instance.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def cached_tokens(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """What the engine would report as cached for a prefix of `blocks` full blocks: vLLM computes at
    least the prompt's last token, so a hit never covers it (num_tokens - 1)."""
    if prompt_tokens <= 0:
        return 0
    return min(blocks, (prompt_tokens - 1) // block_size) * block_size
