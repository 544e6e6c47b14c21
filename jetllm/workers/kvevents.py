"""The KV-event relay: the engine's prefix-cache block events, republished into JetStream.

The engine's batches come in order from kvsource.py. They go out one at a time with acked
publishes, so the instance's `seq` has no gaps, and a retried publish (same Nats-Msg-Id) is
dropped by the server as a duplicate. Whatever cannot be published as it happened (an engine gap,
a backlog while JetStream is away) is replaced by a resync.

A resync is a KvCleared per rank followed by the blocks the relay believes cached. That is the
relay's own view, built from the events it saw (vLLM cannot be asked for its block set): after
an engine gap, blocks stored in the lost batches are missing from it until stored again, and
blocks removed in them linger.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors

from ..aio import backoff, supervised, task_group
from ..schemas import (
    ControlDone,
    ErrorCode,
    InstanceState,
    KvCleared,
    KvEvent,
    KvEventBatch,
    KvResync,
)
from ..subjects import codec
from ..subjects.setup import ensure_kv_events_stream
from .cachedblocks import CachedBlocks
from .context import WorkerContext
from .control import ControlError
from .engine import KvEventSource
from .kvsource import RankReader
from .kvview import BlockSet, chunks

log = logging.getLogger(__name__)

MAX_PENDING = 10_000
"""Batches held while JetStream is slow or away; beyond that they are dropped for a resync."""
RESYNC_WAIT = 10.0
"""How long the kv-resync verb waits for JetStream to acknowledge the snapshot."""

_batch_reader = codec.Decoder(KvEventBatch)


class _Pending:
    __slots__ = ("rank", "engine_seq", "ts", "events")

    def __init__(self, rank: int, engine_seq: int | None, ts: float, events: list[KvEvent]) -> None:
        self.rank = rank
        self.engine_seq = engine_seq
        self.ts = ts
        self.events = events


class KvEventRelay:
    def __init__(
        self, ctx: WorkerContext, sources: dict[int, KvEventSource], state: Callable[[], InstanceState]
    ) -> None:
        """`sources`: the engine's publishers, by rank (none: nothing to relay); `state`: the
        worker's state as the fleet sees it, for the verb's reply."""
        self.ctx = ctx
        self._state = state
        self.sources: dict[int, KvEventSource] = dict(sources)
        self.subject = ctx.names.kv_events(ctx.model, ctx.instance)
        self.running = False
        self.seq = 0
        """The last seq JetStream acknowledged."""
        self.sets: dict[int, BlockSet] = {rank: BlockSet() for rank in self.sources}
        self.follower: CachedBlocks | None = None
        """The decode role's view of the engine's cache, fed every batch and rebuilt by resyncs."""
        self.counters = {
            "engine_batches": 0,
            "replayed": 0,
            "engine_gaps": 0,
            "undecodable": 0,
            "published": 0,
            "resyncs": 0,
            "dropped_for_backlog": 0,
        }
        self._pending: deque[_Pending] = deque()
        self._wake = anyio.Event()
        self._resync_asked = 0
        self._resync_done = 0
        self._resync_reason = "start"
        self._resynced = anyio.Event()
        self.last_resync: tuple[int, int, int] | None = None
        """(first seq, last seq, blocks) of the last snapshot published."""

    @property
    def enabled(self) -> bool:
        """Whether the engine publishes KV-cache events (then `run` relays them for the worker's life)."""
        return bool(self.sources)

    @property
    def cached_blocks(self) -> int:
        """Blocks the engine holds now, every rank together (`jetllm status` shows it)."""
        return sum(len(b.blocks) for b in self.sets.values())

    # the worker's side

    async def run(self) -> None:
        try:
            import zmq.asyncio  # noqa: F401
        except ImportError:
            log.error("KV-cache events are not relayed: pyzmq is not installed")
            return
        await self._load_last_seq()
        self.ask_resync("start")
        self.running = True
        log.info(
            "relaying KV-cache events of %d rank(s) to %s from seq %d",
            len(self.sources),
            self.subject,
            self.seq + 1,
        )
        try:
            async with task_group() as tg:
                tg.start_soon(self._supervised, "publisher", self._publish_loop)
                for rank, source in self.sources.items():
                    tg.start_soon(
                        self._supervised, f"rank {rank} receiver", RankReader(rank, source, self).run
                    )
        finally:
            self.running = False

    def ask_resync(self, reason: str) -> int:
        """Publish a snapshot as soon as the publisher is free; returns a ticket for `wait_resync`."""
        self._resync_asked += 1
        self._resync_reason = reason
        self._wake.set()
        return self._resync_asked

    async def wait_resync(self, ticket: int) -> None:
        while self._resync_done < ticket:
            await self._resynced.wait()

    def take(self, rank: int, engine_seq: int, ts: float, events: list[KvEvent]) -> None:
        """The next engine batch of a rank, in engine order."""
        self.sets.setdefault(rank, BlockSet()).apply(events)
        if self.follower is not None:
            self.follower.apply(rank, events)
        self._enqueue(_Pending(rank, engine_seq, ts, events))

    def engine_cleared(self) -> None:
        """The engine dropped its prefix cache. vLLM reports that only with its next step, so the
        relay says it at once; the engine's own event follows (a harmless repeat)."""
        if not self.running:
            return
        for rank, blocks in self.sets.items():
            blocks.apply([KvCleared()])
            if self.follower is not None:
                self.follower.apply(rank, [KvCleared()])
            self._enqueue(_Pending(rank, None, time.time(), [KvCleared()]))

    async def resync_verb(self, _: None) -> ControlDone:
        if not self.sources:
            raise ControlError(
                "this worker publishes no KV-cache events (start it with --kv-events)",
                code=ErrorCode.CONFLICT,
            )
        if not self.running:
            raise ControlError(
                "the KV-event relay is not running yet; try again shortly", code=ErrorCode.CONFLICT
            )
        ticket = self.ask_resync("requested")
        detail = f"resync queued: JetStream did not acknowledge it within {RESYNC_WAIT:.0f}s"
        with anyio.move_on_after(RESYNC_WAIT):
            await self.wait_resync(ticket)
            assert self.last_resync is not None
            first, last, blocks = self.last_resync
            detail = f"resync published as seq {first}..{last}: {blocks} blocks"
        return ControlDone(instance=self.ctx.instance, verb="kv-resync", detail=detail, state=self._state())

    async def _supervised(self, what: str, fn: Any) -> None:
        """A bug or a broken socket must not take the worker down: log, resync, start again."""
        await supervised(f"KV-event relay: {what}", fn, on_failure=lambda: self.ask_resync("engine-gap"))

    def _enqueue(self, item: _Pending) -> None:
        if len(self._pending) >= MAX_PENDING:
            log.warning(
                "KV events: JetStream is %d batches behind; a resync replaces them", len(self._pending)
            )
            self.counters["dropped_for_backlog"] += len(self._pending)
            self._pending.clear()
            self.ask_resync("backlog")
            return
        self._pending.append(item)
        self._wake.set()

    # JetStream side

    async def _load_last_seq(self) -> None:
        """Continue the instance's numbering: a restarted worker with the same id must not reuse seqs."""
        for delay in backoff(0.2, 5.0):
            try:
                raw = await self.ctx.js.get_last_msg(self.ctx.names.kv_events_stream, self.subject)
                self.seq = _batch_reader.decode(raw.data or b"").seq
                return
            except nats.js.errors.NotFoundError:
                self.seq = 0
                return
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.error(
                    "KV events: the last batch on %s is unreadable (%s); numbering from 1", self.subject, exc
                )
                self.seq = 0
                return
            except Exception as exc:
                log.warning("KV events: cannot read the last batch yet (%s)", exc)
                await anyio.sleep(delay)

    async def _publish_loop(self) -> None:
        while True:
            while not self._pending and self._resync_done >= self._resync_asked:
                self._wake = anyio.Event()
                await self._wake.wait()
            if self._resync_done < self._resync_asked:
                await self._publish_resync()
            else:
                item = self._pending.popleft()
                for events in chunks(item.events, self._limit()):
                    await self._send(
                        KvEventBatch(
                            instance=self.ctx.instance,
                            model=self.ctx.model,
                            dp_rank=item.rank,
                            seq=self.seq + 1,
                            engine_seq=item.engine_seq,
                            engine_ts=item.ts,
                            events=events,
                        )
                    )

    async def _publish_resync(self) -> None:
        ticket, reason = self._resync_asked, self._resync_reason
        self._pending.clear()  # the snapshot holds everything received so far
        now = time.time()
        snapshots = {rank: self.sets[rank].as_events() for rank in sorted(self.sets)}
        if self.follower is not None:
            for rank, snapshot in snapshots.items():
                self.follower.apply(rank, snapshot)
        parts = [
            (rank, events)
            for rank, snapshot in snapshots.items()
            for events in chunks(snapshot, self._limit())
        ]
        blocks = sum(len(b.blocks) for b in self.sets.values())
        first = self.seq + 1
        for i, (rank, events) in enumerate(parts, 1):
            await self._send(
                KvEventBatch(
                    instance=self.ctx.instance,
                    model=self.ctx.model,
                    dp_rank=rank,
                    seq=self.seq + 1,
                    engine_ts=now,
                    events=events,
                    resync=KvResync(reason=reason, part=i, parts=len(parts), blocks=blocks),
                )
            )
        self.counters["resyncs"] += 1
        self.last_resync = (first, self.seq, blocks)
        if reason != "start":
            log.info(
                "KV events: resync (%s) published as seq %d..%d, %d blocks", reason, first, self.seq, blocks
            )
        self._resync_done = ticket
        self._resynced.set()
        self._resynced = anyio.Event()

    def _limit(self) -> int:
        return max(4096, (self.ctx.nc.max_payload or 1 << 20) * 3 // 4)

    async def _send(self, batch: KvEventBatch) -> None:
        """Publish until JetStream acknowledges; only then does `seq` move on."""
        data = codec.encode(batch)
        msg_id = f"{self.ctx.instance}:{batch.seq}"
        failures = 0
        for delay in backoff(0.1, 5.0):
            try:
                await self.ctx.js.publish(
                    self.subject,
                    data,
                    stream=self.ctx.names.kv_events_stream,
                    headers={"Nats-Msg-Id": msg_id},
                    timeout=5.0,
                )
                break
            except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError):
                await self._recreate_stream()
            except Exception as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning(
                        "KV events: publishing seq %d failed %d times (%s); retrying",
                        batch.seq,
                        failures,
                        exc,
                    )
            await anyio.sleep(delay)
        self.seq = batch.seq
        self.counters["published"] += 1

    async def _recreate_stream(self) -> None:
        """Someone deleted the stream (or the server lost it): put it back rather than spin."""
        try:
            await ensure_kv_events_stream(self.ctx.js, self.ctx.names, self.ctx.policy)
            log.warning("KV events: stream %s was missing; created it again", self.ctx.names.kv_events_stream)
        except Exception as exc:
            log.warning(
                "KV events: stream %s is missing and cannot be created (%s)",
                self.ctx.names.kv_events_stream,
                exc,
            )
