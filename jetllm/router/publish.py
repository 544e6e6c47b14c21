"""Where a placed job is published: the one place that knows the directed subject's contract.

The directed-jobs work (each worker also pulls `Names.directed_jobs`, and directed jobs of a dead
worker go back to the shared queue) adds `Client.submit(..., instance=...)`; until the two meet,
this is the router's way to address an instance.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import PubAck

from ..subjects.names import Names


def placed_subject(names: Names, role: str, model: str, instance: str | None) -> str:
    """The instance's directed queue, or the shared queue when `instance` is None."""
    return names.jobs(role, model) if instance is None else names.directed_jobs(role, model, instance)


async def publish_directed(
    js: JetStreamContext,
    names: Names,
    *,
    role: str,
    model: str,
    instance: str | None,
    data: bytes,
    headers: dict[str, str],
    timeout: float = 2.0,
) -> PubAck:
    """Publish a job to `instance`'s directed queue (None: the shared queue). `headers` must carry
    the request id as Nats-Msg-Id: a retried or re-routed copy is then dropped as a duplicate."""
    if "Nats-Msg-Id" not in headers:
        raise ValueError("a placed job needs its request id as the Nats-Msg-Id header")
    subject = placed_subject(names, role, model, instance)
    return await js.publish(subject, data, headers=headers, timeout=timeout)
