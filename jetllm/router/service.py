"""`jetllm router` as a service: take jobs from the routing queue, place each, ack after the placed
copy is stored.

Every router of a (role, model) binds the same durable consumer, so JetStream hands each job to one
of them. The placed copy keeps the request id as Nats-Msg-Id in the jobs stream: a router that dies
after publishing and before acking has its job redelivered to another, whose copy the jobs stream
drops as a duplicate (within its duplicate window, which is longer than the ack wait). A job the
router cannot read goes to the shared queue unchanged, where the worker dead-letters it with the reason.
"""

from __future__ import annotations

import logging

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .. import tracecontext
from ..aio import retried
from ..schemas import GenerateRequest
from ..subjects import codec
from ..subjects.names import Names
from ..subjects.policy import QueuePolicy
from ..subjects.setup import ensure_routing_stream
from .publish import publish_directed
from .router import Router

log = logging.getLogger(__name__)

_jobs = codec.Decoder(GenerateRequest)
_RETRIED = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)


async def bind(nc: NATS, names: Names, role: str, model: str, policy: QueuePolicy, ack_wait: float) -> str:
    js = nc.jetstream(timeout=10)
    await ensure_routing_stream(js, names, policy)
    durable = names.routing_consumer(role, model)
    await js.add_consumer(
        names.routing_stream,
        ConsumerConfig(
            durable_name=durable,
            description=f"jetllm routers of {role} {model}"[:256],
            filter_subject=names.routing(role, model),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait,
            max_deliver=-1,
            num_replicas=0,
        ),
    )
    return durable


async def route_one(nc: NATS, names: Names, router: Router, msg: Msg) -> str | None:
    """Place one job from the routing queue and ack it; returns where it went (None: shared queue)."""
    headers = dict(msg.headers or {})
    instance = None
    try:
        req = _jobs.decode(msg.data, codec.encoding_of(headers))
    except (msgspec.DecodeError, msgspec.ValidationError, codec.UnknownContentType) as exc:
        log.info("router: an unreadable job goes to the shared queue as it is: %s", exc)
        req = None
    if req is not None:
        headers["Nats-Msg-Id"] = req.request_id
        try:
            queued = msg.metadata.timestamp.timestamp()
        except Exception:
            queued = None
        try:
            placement = await router.place(
                req, traceparent=headers.get(tracecontext.HEADER), queued_at=queued
            )
            instance = placement.instance
        except Exception as exc:  # left unacked it would come back forever; a worker says what is wrong
            log.warning("router: cannot place %s (%s); it goes to the shared queue", req.request_id, exc)
    else:
        headers.setdefault("Nats-Msg-Id", f"routed-{msg.metadata.sequence.stream}")
    await retried(
        lambda: publish_directed(
            nc.jetstream(),
            names,
            role=router.role,
            model=router.model,
            instance=instance,
            data=msg.data,
            headers=headers,
        ),
        errors=_RETRIED,
        within=30.0,
        what="publishing a placed job",
    )
    await msg.ack()
    return instance


async def serve(
    nc: NATS,
    names: Names,
    router: Router,
    *,
    policy: QueuePolicy | None = None,
    batch: int = 32,
    ack_wait: float = 30.0,
    ready: anyio.Event | None = None,
) -> None:
    """Place jobs until cancelled. A job that cannot be published is left unacked: it comes back."""
    durable = await bind(nc, names, router.role, router.model, policy or QueuePolicy(), ack_wait)
    sub = await nc.jetstream().pull_subscribe_bind(durable, stream=names.routing_stream)
    if ready is not None:
        ready.set()
    log.info(
        "router %s placing jobs of %s from %s",
        router.name,
        router.model,
        names.routing(router.role, router.model),
    )
    while True:
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except (nats.errors.TimeoutError, TimeoutError):
            continue
        except Exception as exc:  # a server restart: fetch again shortly
            log.warning("router: fetching jobs failed (%s); retrying", exc)
            await anyio.sleep(1.0)
            continue
        for msg in msgs:
            try:
                await route_one(nc, names, router, msg)
            except Exception as exc:
                log.warning("router: job left for redelivery: %s", exc)
