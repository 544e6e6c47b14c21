"""Idempotent creation of jetllm's streams and buckets (their configs: streams.py; the job
consumers: consumers.py).

Every worker and every producer calls these on start, so creation races are normal. A missing
stream is created with the side's settings (its defaults for what it does not name); an existing
one is changed only in what that side owns or needs (streamupdate.py), so whoever connects last
does not decide the others' settings. A bucket (KV or object store) that exists is opened as it
is.

Replicas (copies on a JetStream cluster) follow the same rule: a side that names them
(`--replicas`, `QueuePolicy.replicas`) creates streams and buckets with them and brings every
existing stream and bucket of the namespace to them (`ensure_streams`); a side that does not (None)
leaves existing ones as they are and creates new ones with as many as the namespace's jobs stream
has (1 in a new namespace). So a producer or command started without the flag never scales a
cluster's R3 streams down, and a bucket it makes first still gets R3. How many copies a deployment
keeps is its operator's choice, not whoever came first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from ..aio import retried
from ..errors import NotPermitted, ReplicasUnavailable
from . import streams
from .names import Names
from .policy import QueuePolicy
from .streamupdate import Wanted, changed, update_for

log = logging.getLogger(__name__)
T = TypeVar("T")

_STREAM_IN_USE = 10058
_REPLICAS_NOT_CLUSTERED = 10074

API_WAIT = 30.0
"""Seconds a JetStream API call is retried while the cluster cannot serve it yet: a meta leader
election after a server died, or the new copies of a stream that was just scaled up (the
server answers "insufficient resources" until they exist)."""


def api_call(call: Callable[[], Awaitable[T]], what: str) -> Awaitable[T]:
    """`call`, retried while the cluster cannot serve it yet (`API_WAIT`)."""
    return retried(
        call,
        errors=(nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError),
        within=API_WAIT,
        what=what,
        first=0.2,
        longest=2.0,
    )


async def namespace_replicas(js: JetStreamContext, names: Names) -> int:
    """The replicas of the namespace's jobs stream, which a side that names none follows; 1 when
    the namespace has no jobs stream yet."""
    try:
        info = await api_call(lambda: js.stream_info(names.jobs_stream), "reading the jobs stream")
    except nats.js.errors.NotFoundError:
        return 1
    return info.config.num_replicas or 1


def _replicas_error(exc: nats.js.errors.APIError, name: str, replicas: int) -> Exception:
    if exc.err_code == _REPLICAS_NOT_CLUSTERED:
        return ReplicasUnavailable(
            f"cannot store {name} with replicas={replicas}: the NATS server is not part of a JetStream "
            "cluster; run with --replicas 1 (QueuePolicy(replicas=1)) against a single server, or "
            "connect to a cluster of at least that many servers",
            field="replicas",
        )
    return exc


async def _ensure_stream(js: JetStreamContext, wanted: Wanted, *, rescale: bool) -> None:
    """Create the stream, or change an existing one as `wanted` says (streamupdate.py)."""
    cfg = wanted.config
    name = cfg.name or ""
    try:
        current = (await api_call(lambda: js.stream_info(name), f"reading stream {name}")).config
    except nats.js.errors.NotFoundError:
        try:
            await api_call(lambda: js.add_stream(cfg), f"creating stream {name}")
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code != _STREAM_IN_USE:
                raise _replicas_error(exc, name, cfg.num_replicas or 1) from None
        current = (await api_call(lambda: js.stream_info(name), f"reading stream {name}")).config
    update = update_for(current, wanted, rescale=rescale)
    if update is None:
        return
    log.info("stream %s: updating %s", name, ", ".join(changed(current, update)))
    try:
        await api_call(lambda: js.update_stream(update), f"updating stream {name}")
    except nats.js.errors.APIError as exc:
        raise _replicas_error(exc, name, update.num_replicas or 1) from None


async def _ensure_streams(
    js: JetStreamContext, streams: list[Wanted], *, rescale: bool, maker: str = "a worker"
) -> None:
    """Create or update each stream; an identity that may not (a producer, a router) only checks
    they exist, after one refusal, so it does not collect a refusal per stream. `maker`: who
    creates them, for the error when they do not exist."""
    refused: NotPermitted | None = None
    for wanted in streams:
        if refused is None:
            try:
                await _ensure_stream(js, wanted, rescale=rescale)
                continue
            except NotPermitted as exc:
                refused = exc
        await _existing(js, wanted.config.name or "", refused, maker)


async def _existing(js: JetStreamContext, stream: str, refused: NotPermitted, maker: str) -> None:
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise NotPermitted(
            f"{refused.message}; stream {stream} does not exist yet: start {maker} first (it "
            "creates the stream), or run once with admin credentials",
            op=refused.op,
            subject=refused.subject,
        ) from None


@overload
async def ensure_bucket(js: JetStreamContext, cfg: KeyValueConfig) -> KeyValue: ...
@overload
async def ensure_bucket(js: JetStreamContext, cfg: ObjectStoreConfig) -> ObjectStore: ...
async def ensure_bucket(
    js: JetStreamContext, cfg: KeyValueConfig | ObjectStoreConfig
) -> KeyValue | ObjectStore:
    """The KV bucket or object store `cfg` names, created with `cfg` unless it exists. One that
    exists with other settings is opened as it is, not updated: its data outlives any one writer,
    and whoever made it first chose them (replicas aside: `ensure_streams` rescales them)."""
    name = cfg.bucket or ""  # nats-py refuses an empty name, naming it
    refused: NotPermitted | None = None
    try:
        if isinstance(cfg, KeyValueConfig):
            return await api_call(lambda: js.create_key_value(cfg), f"creating bucket {name}")
        return await api_call(lambda: js.create_object_store(name, cfg), f"creating object store {name}")
    except nats.js.errors.APIError as exc:
        if exc.err_code != _STREAM_IN_USE:
            raise _replicas_error(exc, name, cfg.replicas) from None
    except NotPermitted as exc:  # an identity that only reads it: open it as it is
        refused = exc
    try:
        if isinstance(cfg, KeyValueConfig):
            return await js.key_value(name)
        return await js.object_store(name)
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
        if refused is None:
            raise
        raise NotPermitted(
            f"{refused.message}; {name} does not exist yet: start a worker first, or run once with "
            "admin credentials",
            op=refused.op,
            subject=refused.subject,
        ) from None


async def _rescale_buckets(js: JetStreamContext, names: Names, replicas: int) -> None:
    """Bring the namespace's existing KV buckets and object stores to `replicas` copies."""
    for stream in streams.bucket_streams(names):
        await _rescale(js, stream, replicas)


async def _rescale(js: JetStreamContext, stream: str, replicas: int) -> None:
    try:
        current = (await api_call(lambda: js.stream_info(stream), f"reading {stream}")).config
    except nats.js.errors.NotFoundError:
        return
    if (current.num_replicas or 1) == replicas:
        return
    log.info("%s has %s replicas; rescaling it to %d", stream, current.num_replicas or 1, replicas)
    rescaled = dataclasses.replace(current, num_replicas=replicas)
    try:
        await api_call(lambda: js.update_stream(rescaled), f"rescaling {stream}")
    except nats.js.errors.APIError as exc:
        raise _replicas_error(exc, stream, replicas) from None


async def ensure_registry(js: JetStreamContext, names: Names, *, replicas: int | None = None) -> KeyValue:
    """The registry bucket: workers write it, producers and operators read it."""
    return await ensure_bucket(
        js, streams.registry_bucket(names, replicas or await namespace_replicas(js, names))
    )


async def ensure_lora_bucket(js: JetStreamContext, names: Names, *, replicas: int | None = None) -> KeyValue:
    """The desired LoRA adapters of each model: producers write them, workers follow them."""
    return await ensure_bucket(
        js, streams.lora_bucket(names, replicas or await namespace_replicas(js, names))
    )


async def ensure_streams(js: JetStreamContext, names: Names, policy: QueuePolicy) -> None:
    """Every stream of the namespace, as `policy` says; with `policy.replicas` None, the jobs
    stream's replicas decide the others' (module docstring)."""
    rescale = policy.replicas is not None
    replicas = policy.replicas or await namespace_replicas(js, names)
    await _ensure_streams(js, streams.namespace_streams(names, policy, replicas), rescale=rescale)
    if rescale:
        await _rescale_buckets(js, names, replicas)


async def ensure_kv_events_stream(js: JetStreamContext, names: Names, policy: QueuePolicy) -> None:
    replicas = policy.replicas or await namespace_replicas(js, names)
    await _ensure_stream(
        js, streams.kv_events_stream(names, policy, replicas), rescale=policy.replicas is not None
    )


async def ensure_kv_blocks_stream(
    js: JetStreamContext, names: Names, *, ttl: float, max_bytes: int, replicas: int = 1
) -> None:
    """Where prefill workers leave KV blocks for decode workers (streams.kv_blocks_stream)."""
    wanted = streams.kv_blocks_stream(names, ttl=ttl, max_bytes=max_bytes, replicas=replicas)
    await _ensure_stream(js, wanted, rescale=True)


async def ensure_batch_plane(
    js: JetStreamContext,
    names: Names,
    *,
    ack_wait: float | None = None,
    replicas: int | None = None,
    memory: bool = False,
) -> tuple[ObjectStore, KeyValue]:
    """The OpenAI files and batches of a namespace: the files store, the bucket of batch states,
    and the work-queue stream of batches to run with its one consumer, shared by every runner.
    Batches are re-delivered after the consumer's ack_wait without a sign of life from their
    runner, for as long as it takes (a batch fails on its own terms, never by running out of
    deliveries). `ack_wait` is set only when given (`--batch-ack-wait`); None leaves an existing
    consumer's as it is and gives a new one DEFAULT_BATCH_ACK_WAIT."""
    replicas = replicas or await namespace_replicas(js, names)
    files = await ensure_bucket(js, streams.files_store(names, memory, replicas))
    state = await ensure_bucket(js, streams.batches_bucket(names, memory, replicas))
    await _ensure_stream(js, streams.batch_queue_stream(names, memory, replicas), rescale=False)
    await _ensure_batch_consumer(js, names, ack_wait)
    return files, state


DEFAULT_BATCH_ACK_WAIT = 30.0
"""A new batch consumer's ack_wait when the side creating it was given none."""


async def _ensure_batch_consumer(js: JetStreamContext, names: Names, ack_wait: float | None) -> None:
    try:
        info = await js.consumer_info(names.batch_queue_stream, names.BATCH_RUNNERS)
    except nats.js.errors.NotFoundError:
        info = None
    if info is not None and (ack_wait is None or info.config.ack_wait == ack_wait):
        return
    config = streams.batch_runners(names, DEFAULT_BATCH_ACK_WAIT if ack_wait is None else ack_wait)
    try:
        await api_call(
            lambda: js.add_consumer(names.batch_queue_stream, config), "creating the batch consumer"
        )
    except nats.js.errors.APIError as exc:  # a server that takes no update: it stays as it is
        if info is None:
            raise
        log.warning("could not set the batch consumer's ack_wait to %ss (%s)", ack_wait, exc)


async def ensure_routing_stream(js: JetStreamContext, names: Names, policy: QueuePolicy) -> None:
    """The routing queue (docs/routing.md): made by routers (and by the producers that use them,
    where they may), so a namespace without a router fleet has no stream nobody reads."""
    replicas = policy.replicas or await namespace_replicas(js, names)
    await _ensure_streams(
        js,
        [streams.routing_stream(names, policy, replicas)],
        rescale=policy.replicas is not None,
        maker="a router",
    )
