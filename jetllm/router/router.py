"""The KV-aware router: places each job on the instance that would compute the least of its prompt,
weighed against its load (cost.py), or leaves it to the shared queue.

    router = Router("Qwen/Qwen3-0.6B", tokenizer="Qwen/Qwen3-0.6B")
    async with Client(url, router=router) as c:   # the client starts and stops it
        ...

or alone: `async with router.running(nc, names): placement = await router.place(req)`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from ..producer.registry import instances
from ..schemas import GenerateRequest, InstanceRecord, RouteCandidate, Routed, RouteDecision
from ..subjects import codec
from ..subjects.names import Names
from .cost import Candidate, Choice, Weights, by_load, cached_tokens, choose, shortlist
from .feed import KvFeed, LoadBook, follow_registry
from .hashing import DEFAULT_SEED, BlockHasher, HashAlgo
from .index import BlockIndex
from .pending import PendingBlocks, RecentJobs
from .tokens import PromptTokenizer
from .trace import publish_decision

log = logging.getLogger(__name__)
_routed_decoder = codec.Decoder(Routed)

ROUTED_BLOCKS = 4096
"""Blocks of a peer's note taken at most (a prompt of 64k tokens at 16 a block)."""

HOME_TOKENS = 256
"""A cold prompt's home is ranked by its chain up to the block covering this many tokens: deep
enough that prompts sharing only a chat template's opening do not all share a home, shallow
enough that prompts sharing a system prompt do."""
SESSIONS = 100_000
"""Sessions remembered for affinity (least recently used forgotten first)."""
RANK_EVERY = 0.1
WARM_TIMEOUT = 60.0
"""How long `start` waits for the stored KV events to be applied before it serves cold."""
SNAPSHOT_GRACE = 10.0
STOP_WAIT = 5.0
"""How long `close` lets the feeds finish their current NATS call before it cancels them."""


@dataclass(frozen=True)
class Placement:
    instance: str | None
    """The instance to address the job to; None: the shared queue."""
    decision: RouteDecision


class RouterStats:
    """Counters for the metrics (hit rate, decision time); `jetllm router` exports them."""

    def __init__(self) -> None:
        self.decisions = 0
        self.directed = 0
        self.prompt_tokens = 0
        self.expected_cached_tokens = 0
        self.decision_us: deque[float] = deque(maxlen=10_000)
        self.reasons: dict[str, int] = {}

    @property
    def hit_rate(self) -> float:
        """Prompt tokens expected cached on the chosen instances, over all prompt tokens routed."""
        return self.expected_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def percentile(self, q: float) -> float:
        xs = sorted(self.decision_us)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _reason_kind(why: str) -> str:
    kinds = (
        "session affinity",
        "session start",
        "no cached prefix",
        "prompt's home",
        "tie",
        "no load data",
        "no live instance",
    )
    for kind in kinds:
        if why.startswith(kind):
            return kind
    return "cached prefix"


class Router:
    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | PromptTokenizer | None = None,
        weights: Weights | None = None,
        role: str = "generate",
        block_size: int | None = None,
        hash_seed: str = DEFAULT_SEED,
        hash_algo: HashAlgo = "sha256",
        name: str = "router",
        trace: bool = True,
        load_max_age: float = 5.0,
    ) -> None:
        """`tokenizer`: the model's files (its directory or hub id) for text and chat prompts;
        without one only token prompts are routed. `block_size`: the engine's (else read from
        the registry). `hash_seed`/`hash_algo`: the workers' PYTHONHASHSEED (if they set one) and
        --prefix-caching-hash-algo."""
        self.model = model
        self.role = role
        self.weights = weights or Weights()
        self.tokenizer = PromptTokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.name = name
        self.id = f"{name}-{uuid.uuid4().hex[:12]}"
        """This router among its peers (names may repeat)."""
        self.trace = trace
        self.index = BlockIndex()
        self.pending = PendingBlocks()
        self.recent = RecentJobs()
        self.loads = LoadBook(load_max_age, registered=self._registered)
        self.instances: dict[str, InstanceRecord] = {}
        self.stats = RouterStats()
        self._block_size = block_size
        self._seed = hash_seed
        self._algo: HashAlgo = hash_algo
        self._hasher: BlockHasher | None = (
            BlockHasher(block_size, seed=hash_seed, algo=hash_algo) if block_size else None
        )
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._ranking: tuple[float, list[Candidate], dict[str, int]] | None = None
        self._nc: NATS | None = None
        self._names: Names | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._snapshot: tuple[float, dict[str, InstanceRecord]] = (0.0, {})
        self._watched: set[str] = set()
        """Instances the registry watch has shown (once shown, absence from it means gone)."""
        self._sub: Subscription | None = None
        self._peers: Subscription | None = None
        self.notes: deque[Routed] = deque(maxlen=1024)
        """Placements decided and not yet told to the other routers (`place` tells them)."""
        self.feed: KvFeed | None = None

    # lifecycle

    @property
    def started(self) -> bool:
        return bool(self._tasks)

    async def start(self, nc: NATS, names: Names, *, warm_timeout: float = WARM_TIMEOUT) -> None:
        """Follow the fleet; returns once the KV events stored so far are applied (a restarted
        router is warm from its first job) or after `warm_timeout`."""
        self._nc, self._names = nc, names
        try:  # the live instances now, so the first decision knows them (the watch follows)
            live = await instances(nc.jetstream(timeout=5), names, model=self.model)
            self._snapshot = (time.monotonic(), {r.instance: r for r in live if r.role == self.role})
            self._on_instances({})
        except Exception as exc:
            log.warning("router: cannot read the registry yet (%s); following it", exc)
        self.feed = KvFeed(
            nc, names, self.model, self.index, lambda: self._hasher, registered=self._registered
        )
        self._sub = await nc.subscribe(names.load_of(self.model), cb=self._on_load)
        self._peers = await nc.subscribe(names.routed(self.role, self.model), cb=self._on_routed)
        # plain tasks, not a task group held open across calls: a router may be started and
        # closed from different scopes (a Client's, a test's)
        self._stopping = False
        stopped, feed = self._stopped, self.feed
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._supervised("KV events", lambda: feed.run(stopped))),
            loop.create_task(
                self._supervised(
                    "registry",
                    lambda: follow_registry(nc, names, self.model, self.role, self._on_instances, stopped),
                )
            ),
        ]
        with anyio.move_on_after(warm_timeout) as scope:
            await self.feed.caught_up.wait()
        if scope.cancelled_caught:
            log.warning("router: KV events not replayed within %.0fs; placing jobs meanwhile", warm_timeout)

    async def close(self) -> None:
        for sub in (self._sub, self._peers):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        self._sub = self._peers = None
        tasks, self._tasks = self._tasks, []
        self._stopping = True
        if tasks:  # they stop on their own within a second or two; cancelled only if they do not
            _, late = await asyncio.wait(tasks, timeout=STOP_WAIT)
            for t in late:
                t.cancel()
            for t in late:
                try:
                    await t
                except asyncio.CancelledError:
                    pass

    def _stopped(self) -> bool:
        return self._stopping

    async def _supervised(self, what: str, fn: Callable[[], Awaitable[None]]) -> None:
        """A lost connection or a bug in one feed must not stop the router: log, wait, follow again."""
        while not self._stopping and self._nc is not None and not self._nc.is_closed:
            try:
                await fn()
            except Exception as exc:
                if self._nc.is_closed or self._stopping:
                    return
                log.warning("router: following %s failed (%s); again in 1s", what, exc)
            if not self._stopping:
                await anyio.sleep(1.0)

    @asynccontextmanager
    async def running(self, nc: NATS, names: Names) -> AsyncIterator[Router]:
        await self.start(nc, names)
        try:
            yield self
        finally:
            await self.close()

    async def _on_load(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.loads.take(msg)

    async def _on_routed(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            note = _routed_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # a peer's bug, or not a peer
            log.debug("router: skipping an unreadable placement note: %s", exc)
            return
        self.heard(note)

    def heard(self, note: Routed) -> None:
        """Another router directed a prompt: count its blocks as held there, as for our own."""
        if note.router == self.id or note.instance not in self.instances:
            return  # ours, or an instance we do not know (yet): nothing to follow
        now = time.monotonic()
        self.pending.note(note.blocks[:ROUTED_BLOCKS], note.instance, now)
        self.recent.add(note.instance, now)

    def _on_instances(self, watched: dict[str, InstanceRecord]) -> None:
        """The registry watch's view. It delivers the records present at its start one at a time,
        so an instance missing from it is gone only once the watch has shown it before; records
        of the snapshot read at start count meanwhile (for SNAPSHOT_GRACE seconds)."""
        at, snapshot = self._snapshot
        if time.monotonic() - at > SNAPSHOT_GRACE:
            snapshot = {}
            self._snapshot = (at, {})
            self._watched = set()  # needed only while the snapshot counts: it would grow for ever
        else:
            self._watched |= set(watched)
        current = {**{k: r for k, r in snapshot.items() if k not in self._watched}, **watched}
        for gone in set(self.instances) - set(current):
            self.index.drop(gone)
            self.loads.forget(gone)
            self.recent.forget(gone)
            if self.feed is not None:
                self.feed.forget(gone)
        self.instances = current
        self._ranking = None
        if self._hasher is None:
            size = next((r.engine.block_size for r in current.values() if r.engine.block_size), None)
            if size:
                self._block_size = size
                self._hasher = BlockHasher(size, seed=self._seed, algo=self._algo)

    def _registered(self, instance: str) -> InstanceRecord | None:
        """The live record of `instance`, if the registry shows it: the router keeps load reports
        and KV events of these only (and of the ranks they list)."""
        return self.instances.get(instance)

    # deciding

    def overlaps(self, tokens: list[int], adapter: str | None = None) -> dict[str, int]:
        """Per instance that holds some of it, the prompt tokens its engine would find cached."""
        if self._hasher is None:
            return {}
        return self._cached(self._chain(tokens, adapter), len(tokens))

    def _chain(self, tokens: list[int], adapter: str | None) -> list[int]:
        """The blocks an engine could find cached: the full ones before the prompt's last token."""
        assert self._hasher is not None
        size = self._hasher.block_size
        return self._hasher.chain(tokens[: (len(tokens) - 1) // size * size], adapter)

    def _cached(self, chain: list[int], prompt_tokens: int, pending: bool = False) -> dict[str, int]:
        assert self._hasher is not None
        size = self._hasher.block_size
        blocks = self.index.overlap(chain)
        if pending and chain:
            sent = self.pending.holder(chain, time.monotonic())
            if sent is not None and sent[0] in self.instances and sent[1] > blocks.get(sent[0], 0):
                blocks[sent[0]] = sent[1]
        return {inst: cached_tokens(n, size, prompt_tokens) for inst, n in blocks.items()}

    def _ranked(self) -> tuple[list[Candidate], dict[str, int]]:
        """Live candidates by load, rebuilt at most every RANK_EVERY seconds (reports come each second)."""
        now = time.monotonic()
        if self._ranking is None or now - self._ranking[0] >= RANK_EVERY:
            ranked = by_load(self.candidates(), self.weights)
            self._ranking = (now, ranked, {c.instance: i for i, c in enumerate(ranked)})
        return self._ranking[1], self._ranking[2]

    def candidates(self) -> list[Candidate]:
        """Every instance that can take a job now, with its load and nothing cached."""
        out = []
        for inst, rec in self.instances.items():
            if not rec.ready or rec.state != "serving":
                continue
            reports = self.loads.of(inst)
            if reports:
                running = sum(r.running for r in reports)
                waiting = sum(r.waiting for r in reports)
                slots = max(rec.slots, max(r.slots for r in reports))
                usage = [r.kv_usage for r in reports if r.kv_usage is not None]
                kv = max(usage) if usage else None
            else:
                running, waiting, slots, kv = rec.in_flight, 0, rec.slots, None
            out.append(Candidate(inst, 0, running, waiting, slots, kv))
        return out

    def decide(self, req: GenerateRequest, tokens: list[int] | None) -> Choice:
        if tokens is None:
            return Choice(None, "prompt not tokenized here (no tokenizer, or an embeddings prompt)")
        if self._hasher is None:
            return Choice(None, "block size unknown (no instance registered yet)")
        now = time.monotonic()
        chain = self._chain(tokens, req.adapter)
        cached = self._cached(chain, len(tokens), pending=True)
        session = self._sessions.get(req.session_id) if req.session_id else None
        ranked, position = self._ranked()
        listed = shortlist(ranked, cached, position)
        if session is not None and session in position and all(c.instance != session for c in listed):
            listed.append(ranked[position[session]])
        choice = choose(
            len(tokens),
            listed,
            self.weights,
            cached=cached,
            session=session,
            new_session=req.session_id is not None,
            home_key=chain[min(len(chain), self._home_depth()) - 1] if chain else None,
            recent=lambda inst: self.recent.of(inst, now),
        )
        if choice.instance is not None:
            self.recent.add(choice.instance, now)
            if chain:
                self.pending.note(chain, choice.instance, now)
                self.notes.append(Routed(router=self.id, instance=choice.instance, blocks=chain))
        return choice

    def _home_depth(self) -> int:
        assert self._hasher is not None
        return max(1, HOME_TOKENS // self._hasher.block_size)

    async def place(
        self, req: GenerateRequest, *, traceparent: str | None = None, queued_at: float | None = None
    ) -> Placement:
        """Decide where `req` goes; records the decision in the request's trace."""
        t0 = time.perf_counter()
        started = time.time()
        tokens: list[int] | None = None
        if self.tokenizer is not None:
            try:
                tokens = await self.tokenizer.tokens_async(req.prompt)
            except Exception as exc:  # a template that rejects the prompt: the worker will say why
                log.debug("router: cannot tokenize %s: %s", req.request_id, exc)
        elif hasattr(req.prompt, "token_ids"):
            tokens = list(req.prompt.token_ids)  # type: ignore[union-attr]
        choice = self.decide(req, tokens)
        elapsed_us = (time.perf_counter() - t0) * 1e6
        await self._tell_peers()
        if req.session_id and choice.instance is not None:
            self._sessions[req.session_id] = choice.instance
            self._sessions.move_to_end(req.session_id)
            if len(self._sessions) > SESSIONS:
                self._sessions.popitem(last=False)
        chosen = next((s for s in choice.scored if s.candidate.instance == choice.instance), None)
        expected = chosen.candidate.cached_tokens if chosen is not None else 0
        decision = RouteDecision(
            chosen=choice.instance,
            why=choice.why,
            prompt_tokens=len(tokens or ()),
            expected_cached_tokens=expected,
            candidates=[
                RouteCandidate(
                    instance=s.candidate.instance,
                    cached_tokens=s.candidate.cached_tokens,
                    cost=round(s.cost, 1),
                    running=s.candidate.running,
                    waiting=s.candidate.waiting,
                    slots=s.candidate.slots,
                    kv_usage=s.candidate.kv_usage,
                )
                for s in choice.scored[:8]
            ],
            decision_us=round(elapsed_us, 1),
        )
        self._count(decision)
        if self.trace and self._nc is not None and self._names is not None:
            await publish_decision(
                self._nc,
                self._names,
                req,
                decision,
                router=self.name,
                traceparent=traceparent,
                queued_at=queued_at or started,
                started=started,
            )
        return Placement(choice.instance, decision)

    async def _tell_peers(self) -> None:
        """A peer that misses a note only starts a new prefix elsewhere once: no retry."""
        while self.notes:
            note = self.notes.popleft()
            if self._nc is None or self._names is None:
                continue
            try:
                await self._nc.publish(self._names.routed(self.role, self.model), codec.encode(note))
            except Exception as exc:
                log.debug("router: could not tell the other routers about a placement: %s", exc)

    def _count(self, d: RouteDecision) -> None:
        s = self.stats
        s.decisions += 1
        s.directed += d.chosen is not None
        s.prompt_tokens += d.prompt_tokens
        s.expected_cached_tokens += d.expected_cached_tokens
        s.decision_us.append(d.decision_us)
        kind = _reason_kind(d.why)
        s.reasons[kind] = s.reasons.get(kind, 0) + 1
