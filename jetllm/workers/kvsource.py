"""The engine side of the KV-event relay: vLLM's ZMQ publisher, read in its own batch order.

vLLM publishes each engine step's block events on a ZMQ PUB socket per data-parallel rank. PUB/SUB
drops messages whenever a reader lags, so the reader checks vLLM's batch numbers and fetches what
it missed from vLLM's replay socket; what that no longer holds is an engine gap, which the relay
covers with a resync rather than leave a silent hole.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ..schemas import KvCleared, KvEvent, KvRemoved, KvStored
from .engine import KvEventSource

if TYPE_CHECKING:
    from .kvevents import KvEventRelay

log = logging.getLogger(__name__)

QUIET = 1.0
"""Seconds of engine silence after which the reader asks the replay socket for a lost last batch."""
REPLAY_TIMEOUT = 5.0

_HASH_MASK = (1 << 64) - 1
_END = -1


# vLLM's wire format (vllm/distributed/kv_events.py): the batch is an array, events are tagged
# maps (arrays in older releases). Unknown fields and event types are skipped, not fatal.


class _VStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _VRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _VCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _VStoredA(_VStored, array_like=True):
    pass


class _VRemovedA(_VRemoved, array_like=True):
    pass


class _VClearedA(_VCleared, array_like=True):
    pass


class _VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(_VBatch)
_event_decoders = (
    msgspec.msgpack.Decoder(_VStored | _VRemoved | _VCleared),
    msgspec.msgpack.Decoder(_VStoredA | _VRemovedA | _VClearedA),
)


def _hash(value: int | bytes) -> int:
    """vLLM sends 64-bit ints by default and raw digests otherwise; both become an unsigned 64-bit id."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _HASH_MASK
    return value & _HASH_MASK


def decode_engine_batch(payload: bytes) -> tuple[float, int | None, list[KvEvent]]:
    """(timestamp, dp rank, events) of one vLLM batch; raises msgspec errors when unreadable."""
    raw = _batch_decoder.decode(payload)
    events: list[KvEvent] = []
    for item in raw.events:
        ev: Any = None
        for decoder in _event_decoders:
            try:
                ev = decoder.decode(item)
                break
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
        if isinstance(ev, _VStored):
            events.append(
                KvStored(
                    block_hashes=[_hash(h) for h in ev.block_hashes],
                    parent_block_hash=None if ev.parent_block_hash is None else _hash(ev.parent_block_hash),
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_name=ev.lora_name,
                    medium=ev.medium,
                )
            )
        elif isinstance(ev, _VRemoved):
            events.append(KvRemoved(block_hashes=[_hash(h) for h in ev.block_hashes], medium=ev.medium))
        elif isinstance(ev, _VCleared):
            events.append(KvCleared())
        else:
            log.debug("skipping a KV event of a kind this relay does not know")
    return raw.ts, raw.data_parallel_rank, events


def _connectable(endpoint: str) -> str:
    """A bound wildcard address (`tcp://*:5557`) as a local address to connect to."""
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://[::]:", "://127.0.0.1:")


class RankReader:
    """One rank's engine batches, handed to the relay in vLLM's order with none skipped unnoticed.
    The engine-side counters are kept in the relay's, so one dict describes the whole relay."""

    def __init__(self, rank: int, source: KvEventSource, relay: KvEventRelay) -> None:
        self.rank = rank
        self.source = source
        self.relay = relay

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(_connectable(self.source.endpoint))
        replay = _Replay(ctx, self.source.replay_endpoint)
        last = -1
        try:
            last = await self._catch_up(replay, last)  # whatever came before the SUB connected
            probed = True
            while True:
                frames = None
                with anyio.move_on_after(QUIET if not probed else None):
                    frames = await sub.recv_multipart()
                if frames is None:
                    last = await self._catch_up(replay, last)  # a lost last batch would wait forever
                    probed = True
                    continue
                probed = False
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.relay.counters["undecodable"] += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq <= last:
                    continue
                if seq > last + 1:
                    last = await self._catch_up(replay, last)
                    if seq <= last:
                        continue
                    if seq > last + 1:
                        self._engine_gap(last + 1, seq - 1)
                self._take(seq, frames[2])
                last = seq
        finally:
            sub.close(linger=0)
            replay.close()
            ctx.term()

    async def _catch_up(self, replay: _Replay, last: int) -> int:
        """Take the batches after `last` from vLLM's replay buffer; returns the last one taken."""
        if not replay.available:
            return last
        try:
            with anyio.fail_after(REPLAY_TIMEOUT):
                async for seq, payload in replay.since(last + 1):
                    if seq <= last:
                        continue
                    if seq > last + 1:
                        self._engine_gap(last + 1, seq - 1)  # older than vLLM's replay buffer
                    self.relay.counters["replayed"] += 1
                    self._take(seq, payload)
                    last = seq
        except TimeoutError:
            log.warning(
                "KV events, rank %d: the engine's replay socket did not answer in %.0fs",
                self.rank,
                REPLAY_TIMEOUT,
            )
            replay.reset()
        return last

    def _engine_gap(self, first: int, last: int) -> None:
        log.warning(
            "KV events, rank %d: engine batches %d..%d are lost; publishing a resync", self.rank, first, last
        )
        self.relay.counters["engine_gaps"] += 1
        self.relay.ask_resync("engine-gap")

    def _take(self, seq: int, payload: bytes) -> None:
        try:
            ts, batch_rank, events = decode_engine_batch(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning(
                "KV events, rank %d: batch %d is unreadable (%s); publishing a resync", self.rank, seq, exc
            )
            self.relay.counters["undecodable"] += 1
            self.relay.ask_resync("engine-gap")
            return
        self.relay.counters["engine_batches"] += 1
        if not events:
            return
        self.relay.take(batch_rank if batch_rank is not None else self.rank, seq, ts, events)


class _Replay:
    """A DEALER on vLLM's replay ROUTER: send a start seq, read (seq, payload) until seq -1."""

    def __init__(self, ctx: Any, endpoint: str | None) -> None:
        self._ctx = ctx
        self._endpoint = _connectable(endpoint) if endpoint else None
        self._sock: Any = None
        self.available = endpoint is not None
        self.reset()

    def reset(self) -> None:
        """A fresh socket, so late answers to an abandoned request cannot be taken for new ones."""
        import zmq

        self.close()
        if self._endpoint:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self._endpoint)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def since(self, start: int) -> Any:
        await self._sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == _END:
                return
            yield seq, frames[3]
