"""Keeps one worker visible: its registry record and model card, and its load reports.

The record is rewritten every `interval` seconds whatever happens (the heartbeat); a write that
fails is retried at the next beat, so a broker restart only delays it. On a clean stop the record
is deleted at once; after a crash it ages out of the bucket (`RECORD_TTL`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from ..aio import task_group
from ..schemas import InstanceRecord, LoadReport, ModelCard
from ..subjects import codec
from ..subjects.names import Names
from ..subjects.setup import ensure_registry
from ..subjects.streams import RECORD_TTL

log = logging.getLogger(__name__)


def expires_after(interval: float) -> float:
    """Seconds after its heartbeat when a record stops counting as alive: three missed beats."""
    return min(RECORD_TTL, 3 * interval)


class RegistryKeeper:
    def __init__(
        self,
        nc: NATS,
        names: Names,
        record: Callable[[], InstanceRecord],
        card: Callable[[], ModelCard],
        load: Callable[[], list[LoadReport]],
        *,
        interval: float = 2.0,
        load_interval: float = 1.0,
        replicas: int | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=5)
        self.names = names
        self._record = record
        self._card = card
        self._load = load
        self.interval = interval
        self.load_interval = load_interval
        self.replicas = replicas
        self._kv: KeyValue | None = None
        self._card_every = 0.0
        self._wake = anyio.Event()

    def expires_after(self) -> float:
        return expires_after(self.interval)

    def beat_now(self) -> None:
        """Write the record at once (a state change should not wait for the next beat)."""
        self._wake.set()

    async def run(self) -> None:
        async with task_group() as tg:
            tg.start_soon(self._beat)
            tg.start_soon(self._publish_load)

    async def announce(self, **fields: Any) -> None:
        """Write the record (with `fields` changed) and the model card now, before the worker says
        it serves: whoever sees it serving finds it in the registry too. A failed write is logged;
        the heartbeat writes it again."""
        try:
            await self._write(msgspec.structs.replace(self._record(), **fields), with_card=True)
        except Exception as exc:
            log.warning("registry record not written: %s", exc)
            self._kv = None

    async def _write(self, record: InstanceRecord, *, with_card: bool) -> None:
        if self._kv is None:
            self._kv = await ensure_registry(self.js, self.names, replicas=self.replicas)
        await self._kv.put(self.names.instance_key(record.instance), codec.encode(record))
        if with_card:
            card = self._card()
            await self._kv.put(self.names.model_card_key(card.model), codec.encode(card))
            self._card_every = time.monotonic() + RECORD_TTL / 2

    async def _beat(self) -> None:
        while True:
            try:
                await self._write(self._record(), with_card=time.monotonic() >= self._card_every)
            except Exception as exc:
                log.warning("registry heartbeat not written: %s", exc)
                self._kv = None
            with anyio.move_on_after(self.interval):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def _publish_load(self) -> None:
        while True:
            await anyio.sleep(self.load_interval)
            try:
                for report in self._load():
                    await self.nc.publish(
                        self.names.load(report.model, report.instance), codec.encode(report)
                    )
            except Exception as exc:
                log.debug("load report not sent: %s", exc)

    async def remove(self, instance: str) -> None:
        """Take the record out now (clean stop): routers must not pick a worker that is leaving."""
        try:
            kv = self._kv or await ensure_registry(self.js, self.names, replicas=self.replicas)
            await kv.delete(self.names.instance_key(instance))
        except Exception as exc:
            log.warning("registry record not removed (it ages out in %.0fs): %s", RECORD_TTL, exc)
