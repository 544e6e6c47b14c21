"""The registry: a KV bucket of live instances and model cards, written by workers, read by anyone.

A record lives for the bucket's age limit after its last heartbeat (the server removes it and
leaves a delete marker that watchers see); readers also drop records whose `heartbeat_at` is older
than `expires_after`, so a dead worker stops counting at the first of the two.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ..schemas import InstanceRecord, ModelCard
from ..subjects import codec
from ..subjects.directed import record_alive
from ..subjects.kvsnapshot import entries_matching
from ..subjects.names import Names

log = logging.getLogger(__name__)

_instance = codec.Decoder(InstanceRecord)
_card = codec.Decoder(ModelCard)


alive = record_alive


async def instance(kv: KeyValue, names: Names, instance_id: str) -> InstanceRecord | None:
    """The registry record of one instance as it is now (alive or not); None without one."""
    try:
        entry = await kv.get(names.instance_key(instance_id))
    except nats.js.errors.KeyNotFoundError:
        return None
    return _readable(_instance, entry.key, entry.value)


async def _latest(js: JetStreamContext, names: Names, pattern: str, decoder: codec.Decoder) -> list[Any]:
    """Current records under the registry keys matching `pattern`; none before any worker made the bucket."""
    try:
        kv = await js.key_value(names.registry_bucket)
    except nats.js.errors.BucketNotFoundError:
        return []
    entries = [e for e in await entries_matching(kv, pattern) if e.value]
    found = [_readable(decoder, e.key, e.value) for e in entries]
    return [record for record in found if record is not None]


def _readable(decoder: codec.Decoder, key: str, value: bytes | None) -> Any:
    """The record, or None for one no worker wrote (anyone can write the bucket): one bad entry must
    not make the registry unreadable for every fleet command and fan-out."""
    if not value:
        return None
    try:
        return decoder.decode(value)
    except msgspec.DecodeError as exc:  # codec.Decoder raises it for bad UTF-8 and deep nesting too
        log.warning("registry entry %r ignored: not a record jetllm wrote (%s)", key, exc)
        return None


async def instances(js: JetStreamContext, names: Names, *, model: str | None = None) -> list[InstanceRecord]:
    """Live instances (of `model`, if given), sorted by instance id."""
    records = await _latest(js, names, "i.*", _instance)
    found = [r for r in records if alive(r) and (model is None or r.model == model)]
    return sorted(found, key=lambda r: r.instance)


async def model_cards(js: JetStreamContext, names: Names) -> list[ModelCard]:
    cards = await _latest(js, names, "m.*", _card)
    return sorted(cards, key=lambda c: c.model)


async def watch(js: JetStreamContext, names: Names) -> AsyncIterator[dict[str, InstanceRecord]]:
    """The live instances after every change (and at least every second, so expiry shows).

    Readers (a router, a gateway, `jetllm top`) open the bucket and never make it: its settings
    are the workers', and a router or producer identity may not. Until a worker has made it, the
    fleet is empty."""
    while True:
        try:
            kv = await js.key_value(names.registry_bucket)
            break
        except nats.js.errors.BucketNotFoundError:
            yield {}
            await anyio.sleep(1.0)
    watcher = await kv.watch("i.*")
    current: dict[str, InstanceRecord] = {}
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=1.0)
            except TimeoutError:
                entry = None
            except nats.errors.TimeoutError:
                entry = None
            if entry is not None:
                record = None
                if entry.operation not in ("DEL", "PURGE") and entry.value:
                    record = _readable(_instance, entry.key, entry.value)
                if record is None:
                    current.pop(entry.key, None)
                else:
                    current[entry.key] = record
            yield {k: r for k, r in current.items() if alive(r)}
    finally:
        try:
            await watcher.stop()
        except Exception:
            pass
