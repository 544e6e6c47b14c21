"""Which subject a job is published to: the routing queue (a router fleet places it), the instance
a router in this process chooses, the instance the caller names (its directed queue, while the
registry says it can take the job now), or else the shared queue."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ..errors import NotPermitted
from ..router.publish import placed_subject
from ..schemas import GenerateRequest
from ..subjects.directed import placement
from ..subjects.names import Names
from . import registry

if TYPE_CHECKING:
    from ..router import Router

log = logging.getLogger(__name__)


class Addressing:
    def __init__(self, names: Names, router: Router | None, via_routers: bool) -> None:
        if router is not None and via_routers:
            raise ValueError("give either router (place jobs here) or via_routers (a router fleet does)")
        self.names = names
        self.router = router
        self.via_routers = via_routers
        self._registry: KeyValue | None = None

    async def subject(
        self, js: JetStreamContext, role: str, req: GenerateRequest, traceparent: str, instance: str | None
    ) -> str:
        if instance is None and self.via_routers:
            return self.names.routing(role, req.model)
        if instance is None and self.router is not None and self.router.model == req.model:
            chosen = await self.router.place(req, traceparent=traceparent)
            return placed_subject(self.names, role, req.model, chosen.instance)
        if instance is None:
            return self.names.jobs(role, req.model)
        return await self._directed(js, role, req, instance)

    async def _directed(self, js: JetStreamContext, role: str, req: GenerateRequest, instance: str) -> str:
        """The directed queue of `instance` if it can take the job now, else the shared queue."""
        try:
            if self._registry is None:
                self._registry = await js.key_value(self.names.registry_bucket)
            record = await registry.instance(self._registry, self.names, instance)
        except nats.js.errors.BucketNotFoundError:
            record = None  # no worker ever started: no instance to address
        except (nats.errors.Error, NotPermitted) as exc:
            # A placement is a preference: the job is not held up by a registry it cannot read.
            log.warning(
                "request %s goes to the shared queue: the registry is not readable: %s", req.request_id, exc
            )
            return self.names.jobs(role, req.model)
        why = placement(record, role, req.model, time.time())
        if why is None:
            return self.names.directed_jobs(role, req.model, instance)
        log.info("request %s goes to the shared queue, not to %s: %s", req.request_id, instance, why)
        return self.names.jobs(role, req.model)
