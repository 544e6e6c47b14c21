"""Asking the running workers of a namespace about themselves (scatter-gather over core NATS)."""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from ..errors import NotPermitted
from ..schemas import ControlDone, ControlFailed, HealthReport, StatusRequest, TasksReport, WorkerStatus
from ..subjects import codec
from ..subjects.denials import checked
from ..subjects.names import Names
from .registry import instances

_decoder = codec.Decoder(WorkerStatus)
ControlReply = ControlDone | ControlFailed | HealthReport | TasksReport
_reply_decoder = codec.Decoder(ControlReply)


async def gather(
    nc: NATS,
    subject: str,
    body: bytes,
    decoder: Any,
    timeout: float,
    expected: AbstractSet[str] = frozenset(),
) -> list:
    """Publish once and collect the decodable replies, each naming its `instance`, until `timeout` or
    until every instance in `expected` has answered; sorted by instance. Every fan-out (status,
    control verbs, adapters) goes through here, so a missing answer looks the same everywhere."""
    inbox = nc.new_inbox()
    replies: list = []
    answered: set[str] = set()
    sub = await nc.subscribe(inbox)
    try:
        async with checked(nc, "publish", subject):  # a refused verb is an error, not silence
            await nc.publish(subject, body, reply=inbox)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and not (expected and expected <= answered):
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.Error:  # the time is up (or the connection went): what came is the answer
                break
            try:
                reply = decoder.decode(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            answered.add(reply.instance)
            replies.append(reply)
    finally:
        await sub.unsubscribe()
    return sorted(replies, key=lambda r: r.instance)


async def worker_statuses(nc: NATS, names: Names, timeout: float = 0.5) -> list[WorkerStatus]:
    """Every worker that answers within `timeout`, sorted by instance id."""
    return await gather(nc, names.control("status"), codec.encode(StatusRequest()), _decoder, timeout)


async def instance_status(nc: NATS, names: Names, instance: str, timeout: float = 5.0) -> WorkerStatus:
    """One worker's status, waiting as long as `timeout` for it (a busy worker may answer late);
    raises LookupError when no such worker is listening."""
    try:
        msg = await nc.request(
            names.instance_control(instance, "status"), codec.encode(StatusRequest()), timeout=timeout
        )
    except nats.errors.NoRespondersError:
        raise LookupError(f"no worker {instance} answers") from None
    return _decoder.decode(msg.data)


async def wait_for_workers(
    nc: NATS, names: Names, *, model: str | None = None, count: int = 1, timeout: float = 120.0
) -> list[WorkerStatus]:
    """Wait until `count` workers (of `model`, if given) are serving; raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            s
            for s in await worker_statuses(nc, names, timeout=0.3)
            if s.state == "serving" and (model is None or s.model == model)
        ]
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(found)} of {count} workers serving after {timeout}s")
        await anyio.sleep(0.2)


async def ask(
    nc: NATS,
    names: Names,
    verb: str,
    body: bytes = b"",
    *,
    instance: str | None = None,
    model: str | None = None,
    timeout: float = 10.0,
) -> list[ControlReply]:
    """Send a control verb to one instance, or to every instance of `model`; one reply per instance.

    A fan-out waits for a reply from every instance the registry lists for the model (or until
    `timeout`), so a missing answer is visible as a missing row rather than a hang.
    """
    if (instance is None) == (model is None):
        raise ValueError("name exactly one of instance or model")
    if instance is not None:
        try:
            msg = await nc.request(names.instance_control(instance, verb), body, timeout=timeout)
        except nats.errors.NoRespondersError:
            raise LookupError(f"no instance {instance!r} answers (not running, or not serving yet)") from None
        return [_reply_decoder.decode(msg.data)]
    assert model is not None  # exactly one of the two, checked above
    try:
        expected = {r.instance for r in await instances(nc.jetstream(), names, model=model)}
    except NotPermitted:  # an identity that may not read the registry: the verb itself says if it may
        expected = set()
    # Nothing registered (registry unreachable, or workers just starting): take what comes in 1 s.
    return await gather(
        nc,
        names.model_control(model, verb),
        body,
        _reply_decoder,
        timeout if expected else min(timeout, 1.0),
        expected,
    )
