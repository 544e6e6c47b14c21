"""The model's desired adapters, as this worker has read them from the LoRA bucket.

The bucket's keys for this model are watched from the start, so adapters loaded before this worker
started are wanted here too, and the watch is resumed after any error: a watch that stopped would
miss every later change. Anyone can write the bucket, so an entry no adapter could have is
skipped, and a value this version cannot read fails that revision instead of reading as "unload".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from ...aio import task_group
from ...schemas import AdapterSpec, ErrorCode
from ...schemas.lora import AdapterName
from ...subjects import codec
from ...subjects.kvsnapshot import SnapshotEnd
from ...subjects.names import Names
from ...subjects.setup import ensure_lora_bucket
from ..control import naming_field

log = logging.getLogger(__name__)

_spec = codec.Decoder(AdapterSpec)


class DesiredSet:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        model: str,
        *,
        replicas: int | None,
        on_unreadable: Callable[[str, int, ErrorCode, str], None],
    ) -> None:
        """`on_unreadable`: told (name, revision, code, message) of a revision that cannot be read."""
        self._js = js
        self._names = names
        self._model = model
        self._replicas = replicas
        self._on_unreadable = on_unreadable
        self._desired: dict[str, tuple[int, AdapterSpec | None]] = {}
        self.kept: set[str] = set()
        """Adapters whose newest desired state could not be read: the loaded one goes on serving."""
        self.synced = anyio.Event()
        """Set once the watch has read what the bucket held: before, an adapter not read yet may exist."""

    def get(self, name: str) -> tuple[int, AdapterSpec | None]:
        """(revision, spec) last read for the adapter; spec None: not wanted."""
        return self._desired.get(name, (0, None))

    async def watch(self, reconcile: Callable[[str], Awaitable[None]]) -> None:
        """Follow the model's keys in the LoRA bucket for the worker's life (re-watch after errors)."""
        async with task_group() as tg:
            while True:
                try:
                    kv = await ensure_lora_bucket(self._js, self._names, replicas=self._replicas)
                    keys = self._names.lora_keys_of(self._model)
                    watcher = await kv.watch(keys)
                    end = SnapshotEnd()
                    try:
                        while True:
                            try:
                                entry = await watcher.updates(timeout=5.0)
                            except (TimeoutError, nats.errors.TimeoutError):
                                if end.quiet():
                                    self.synced.set()
                                continue
                            if entry is None:
                                if await end.marker(kv, keys):
                                    self.synced.set()
                                continue
                            self._follow(entry, tg, reconcile)
                            if end.entry(entry):
                                self.synced.set()
                    finally:
                        await watcher.stop()
                except Exception as exc:
                    log.warning("LoRA desired-state watch failed (%s); watching again", exc)
                    await anyio.sleep(1.0)

    def _follow(self, entry: Any, tg: Any, reconcile: Callable[[str], Awaitable[None]]) -> None:
        """One change of the desired set. An entry that no adapter could have (a key that is not an
        encoded adapter name, a value that breaks decoding) is skipped, so it cannot stop the watch."""
        try:
            name = self._names.adapter_from_key(entry.key)
            msgspec.convert(name, AdapterName)
        except (ValueError, msgspec.ValidationError) as exc:  # a UnicodeDecodeError is a ValueError
            log.warning("LoRA bucket key %r ignored: not an adapter name (%s)", entry.key, exc)
            return
        try:
            deleted = entry.operation in ("DEL", "PURGE") or not entry.value
            if self._apply(name, entry.revision, None if deleted else entry.value):
                tg.start_soon(reconcile, name)
        except Exception:
            log.exception("adapter %r: desired-state entry (revision %s) ignored", name, entry.revision)

    def _apply(self, name: str, revision: int, value: bytes | None) -> bool:
        last, previous = self.get(name)
        if revision <= last:
            return False
        spec = None
        self.kept.discard(name)
        if value is not None:
            try:
                spec = _spec.decode(value)
            except msgspec.DecodeError as exc:  # a ValidationError is one too
                self._unreadable(name, revision, exc)
                self.kept.add(name)
                spec = previous
        self._desired[name] = (revision, spec)
        return True

    def _unreadable(self, name: str, revision: int, exc: msgspec.DecodeError) -> None:
        """A value this worker cannot read (a field of a newer jetllm, a hand-edited key) says
        nothing about what is wanted: the adapter stays as it is and goes on serving its jobs (in
        a rolling upgrade the newer workers serve the new spec), and this revision fails, so the
        verb and `lora-list` say why instead of the adapter being unloaded."""
        code = ErrorCode.INVALID_REQUEST if isinstance(exc, msgspec.ValidationError) else ErrorCode.MALFORMED
        message = (
            f"adapter {name!r}: its desired state (revision {revision}) cannot be read: "
            f"{naming_field(exc)}; it stays as it was until the key holds a spec this version reads "
            "(or is deleted: jetllm lora unload)"
        )
        log.warning("%s", message)
        self._on_unreadable(name, revision, code, message)

    async def refresh(self, name: str) -> None:
        """Read the adapter's key now: a verb must not act on a watch that lags behind its caller."""
        kv = await ensure_lora_bucket(self._js, self._names, replicas=self._replicas)
        key = self._names.lora_key(self._model, name)
        try:
            entry = await kv.get(key)
            # nats-py types KeyValue.Entry.revision Optional; a fetched entry has one
            self._apply(name, entry.revision, entry.value or None)  # type: ignore[arg-type]
        except nats.js.errors.KeyDeletedError as exc:
            self._apply(name, exc.entry.revision if exc.entry else 0, None)
        except nats.js.errors.KeyNotFoundError:
            self._desired[name] = (self.get(name)[0], None)
