"""The durable pull consumers workers take jobs from: one shared per (role, model), and one per
instance for the jobs addressed to it."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .names import Names
from .policy import QueuePolicy
from .setup import api_call


async def ensure_consumer(
    js: JetStreamContext, names: Names, role: str, model: str, policy: QueuePolicy
) -> str:
    """Create (or update) the durable pull consumer of (role, model); returns its name."""
    durable = names.consumer(role, model)
    config = _job_consumer(durable, f"jetllm {role} workers of {model}", names.jobs(role, model), policy)
    await api_call(lambda: js.add_consumer(names.jobs_stream, config), f"creating consumer {durable}")
    return durable


DIRECTED_IDLE = 3600.0
"""Seconds after which the server removes a directed consumer nobody pulled from (a live worker
that lost its own this way makes it again, `DirectedQueue.check`)."""
RETIRED_IDLE = 5.0
"""The same for a directed consumer whose instance stopped or is gone: workers may not delete
consumers (the shared one is among them), so a retired one is left to the server to remove."""


async def ensure_directed_consumer(
    js: JetStreamContext,
    names: Names,
    role: str,
    model: str,
    instance: str,
    policy: QueuePolicy,
    *,
    retire: bool = False,
) -> str:
    """Create (or update) the durable pull consumer of one instance's directed queue; `retire`:
    let the server remove it a few seconds after its last pull."""
    durable = names.directed_consumer(role, model, instance)
    config = _job_consumer(
        durable,
        f"jetllm {role} jobs of {model} addressed to {instance}",
        names.directed_jobs(role, model, instance),
        policy,
        inactive_threshold=RETIRED_IDLE if retire else DIRECTED_IDLE,
    )
    await api_call(lambda: js.add_consumer(names.jobs_stream, config), f"creating consumer {durable}")
    return durable


def _job_consumer(
    durable: str,
    description: str,
    subject: str,
    policy: QueuePolicy,
    *,
    inactive_threshold: float | None = None,
) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        description=description[:256],
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=policy.ack_wait,
        max_deliver=policy.max_deliver,
        max_ack_pending=policy.max_ack_pending,
        max_waiting=512,
        # as many copies as the stream (0): a consumer cannot have more, and one with fewer
        # would lose its deliveries' state with the server it lives on
        num_replicas=0,
        inactive_threshold=inactive_threshold,
    )
