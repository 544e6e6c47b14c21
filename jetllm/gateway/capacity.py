"""Which models the fleet serves and whether a request can be taken now.

The gateway keeps the registry's live instances in memory (a watch), and each model's queue depth
for a moment: caches that any replica rebuilds from NATS, so it stays stateless. The decisions
themselves (`resolve`, `admit`) are plain functions over what was read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextlib import aclosing

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from ..openai.errors import OpenAIError
from ..openai.translate import Route, served_route
from ..producer import registry
from ..schemas import InstanceRecord
from ..subjects.names import Names

log = logging.getLogger(__name__)

DEPTH_TTL = 0.5
"""Seconds a model's queue depth is reused before it is read again."""
MISS_REFRESH = 1.0
"""A model nobody serves, per the cache, makes the gateway reread the registry at most this often."""


def serving(r: InstanceRecord) -> bool:
    return r.state == "serving" and r.ready


def resolve(name: str, live: Iterable[InstanceRecord], known: Iterable[str], retry_after: int) -> Route:
    """The model (and adapter) a request's `model` names. A model some live worker serves, or an
    adapter loaded on one, is served; a model that has workers, none of them taking jobs now, or
    whose card says it was served, is 503 (it may be back soon); anything else is 404."""
    live = list(live)
    route = served_route(name, live)
    if route is not None:
        return route
    if any(r.model == name or name in r.adapters for r in live) or name in set(known):
        raise OpenAIError(
            503,
            f"no worker is serving model {name!r} right now; retry later",
            param="model",
            code="no_capacity",
            retry_after=retry_after,
        )
    raise OpenAIError(
        404,
        f"the model {name!r} does not exist; GET /v1/models lists the models served",
        param="model",
        code="model_not_found",
    )


def admit(model: str, depth: int, max_queue: int | None, retry_after: int, jobs: int = 1) -> None:
    """Refuse a request while its model's queue already holds more than `max_queue` jobs no worker
    has taken: waiting behind them would exceed any client's patience. A request of several jobs
    (prompts) counts all but its last as waiting already, except on an empty queue, which takes any
    request (else one of more prompts than the limit could never run)."""
    if max_queue is None or depth == 0:
        return
    if depth + jobs - 1 > max_queue:
        adds = f" and this request adds {jobs}" if jobs > 1 else ""
        raise OpenAIError(
            429,
            f"{depth} requests for {model!r} are waiting for a worker{adds} (the limit is --max-queue "
            f"{max_queue}); retry later",
            code="queue_full",
            retry_after=retry_after,
        )


def unreachable(exc: Exception, retry_after: int) -> OpenAIError:
    """NATS or JetStream unreachable (or a stream leader moving): the fleet may be fine, this
    gateway cannot tell, so the client retries rather than treats it as its own fault."""
    return OpenAIError(
        503,
        f"the gateway cannot reach NATS ({type(exc).__name__}); retry later",
        code="no_capacity",
        retry_after=retry_after,
    )


def models(live: Iterable[InstanceRecord]) -> list[dict[str, object]]:
    """OpenAI model objects: each served model, then each loaded adapter (its `parent` is the model)."""
    found: dict[str, dict[str, object]] = {}
    adapters: dict[str, dict[str, object]] = {}
    for r in sorted(live, key=lambda r: r.instance):
        if not serving(r):
            continue
        created = int(r.started_at)
        found.setdefault(
            r.model,
            {
                "id": r.model,
                "object": "model",
                "created": created,
                "owned_by": "jetllm",
                "root": r.model,
                "parent": None,
                "max_model_len": r.engine.max_model_len or None,
            },
        )
        for a in r.adapters:
            adapters.setdefault(
                a,
                {
                    "id": a,
                    "object": "model",
                    "created": created,
                    "owned_by": "jetllm",
                    "root": a,
                    "parent": r.model,
                    "max_model_len": r.engine.max_model_len or None,
                },
            )
    return [*found.values(), *(a for name, a in adapters.items() if name not in found)]


class FleetView:
    """The registry's live instances and the models' cards, kept current by a watch."""

    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self.js = js
        self.names = names
        self.instances: dict[str, InstanceRecord] = {}
        self.known: set[str] = set()
        self._depths: dict[str, tuple[float, int]] = {}
        self._refreshed = 0.0

    def live(self) -> list[InstanceRecord]:
        now = time.time()
        return [r for r in self.instances.values() if registry.alive(r, now)]

    async def refresh(self) -> None:
        self._refreshed = time.monotonic()
        found = await registry.instances(self.js, self.names)
        self.instances = {Names.instance_key(r.instance): r for r in found}
        self.known = {c.model for c in await registry.model_cards(self.js, self.names)}

    async def watch(self) -> None:
        """Runs for the gateway's life; a broken watch is started again."""
        while True:
            try:
                async with aclosing(registry.watch(self.js, self.names)) as updates:  # type: ignore[type-var]
                    async for current in updates:
                        self.instances = current
            except Exception as exc:
                log.warning("registry watch failed (%s); watching again in 1s", exc)
                await anyio.sleep(1.0)

    async def reread(self, retry_after: int) -> None:
        """`refresh` for a request waiting on it: NATS out of reach is a 503 with Retry-After."""
        try:
            await self.refresh()
        except nats.errors.Error as exc:
            raise unreachable(exc, retry_after) from None

    async def route(self, name: str, retry_after: int) -> Route:
        try:
            return resolve(name, self.live(), self.known, retry_after)
        except OpenAIError:
            if time.monotonic() - self._refreshed < MISS_REFRESH:
                raise
        await self.reread(retry_after)  # a worker that came up a moment ago, or a gateway just started
        return resolve(name, self.live(), self.known, retry_after)

    async def depth(self, model: str) -> int:
        """Jobs of `model` no worker has taken yet (its shared consumer's pending count)."""
        now = time.monotonic()
        cached = self._depths.get(model)
        if cached is not None and now - cached[0] < DEPTH_TTL:
            return cached[1]
        try:
            info = await self.js.consumer_info(self.names.jobs_stream, self.names.consumer("generate", model))
            pending = int(info.num_pending or 0)
        except nats.js.errors.NotFoundError:
            pending = 0
        except Exception as exc:  # not permitted, or NATS busy: better to queue than to refuse
            if model not in self._depths:
                log.warning("cannot read the queue depth of %r (%s); --max-queue is not applied", model, exc)
            pending = 0
        self._depths[model] = (now, pending)
        return pending
