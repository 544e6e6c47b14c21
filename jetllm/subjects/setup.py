"""Idempotent creation of jetllm's streams and buckets (the job consumers: consumers.py).

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
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import OBJ_STREAM_TEMPLATE, ObjectStore

from ..aio import retried
from ..errors import NotPermitted, ReplicasUnavailable
from .names import Names
from .policy import QueuePolicy
from .streamupdate import Wanted, changed, update_for

log = logging.getLogger(__name__)
T = TypeVar("T")

_STREAM_IN_USE = 10058
_REPLICAS_NOT_CLUSTERED = 10074

RECORD_TTL = 10.0
"""Seconds a registry record outlives its last heartbeat in the bucket (the bound after a SIGKILL)."""


def _named(policy: QueuePolicy, **fields: str) -> tuple[str, ...]:
    """The stream config fields (keys) whose policy setting (value) this side chose."""
    return tuple(cfg for cfg, setting in fields.items() if getattr(policy, setting) is not None)


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
    for stream in (
        f"KV_{names.registry_bucket}",
        f"KV_{names.lora_bucket}",
        OBJ_STREAM_TEMPLATE.format(bucket=names.adapters_store),
        OBJ_STREAM_TEMPLATE.format(bucket=names.embeds_store),
        OBJ_STREAM_TEMPLATE.format(bucket=names.files_store),
        f"KV_{names.batches_bucket}",
        names.batch_queue_stream,
    ):
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
        js,
        KeyValueConfig(
            bucket=names.registry_bucket,
            description="jetllm registry: live instances (i.*) and model cards (m.*)",
            history=1,
            ttl=RECORD_TTL,
            storage=StorageType.FILE,
            replicas=replicas or await namespace_replicas(js, names),
            limit_marker_ttl=RECORD_TTL,
        ),
    )


async def ensure_lora_bucket(js: JetStreamContext, names: Names, *, replicas: int | None = None) -> KeyValue:
    """The desired LoRA adapters of each model: producers write them, workers follow them."""
    return await ensure_bucket(
        js,
        KeyValueConfig(
            bucket=names.lora_bucket,
            description="jetllm: LoRA adapters each model should serve",
            history=5,
            storage=StorageType.FILE,
            replicas=replicas or await namespace_replicas(js, names),
        ),
    )


async def ensure_streams(js: JetStreamContext, names: Names, policy: QueuePolicy) -> None:
    """Every stream of the namespace, as `policy` says; with `policy.replicas` None, the jobs
    stream's replicas decide the others' (module docstring)."""
    rescale = policy.replicas is not None
    replicas = policy.replicas or await namespace_replicas(js, names)
    storage = StorageType.MEMORY if policy.memory else StorageType.FILE
    jobs = StreamConfig(
        name=names.jobs_stream,
        description="jetllm jobs: one shared durable pull consumer per (role, model)",
        subjects=[names.jobs_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage,
        num_replicas=replicas,
        max_age=policy.setting("max_age"),
        duplicate_window=policy.setting("duplicate_window"),
        discard=DiscardPolicy.OLD,
    )
    dead_letters = StreamConfig(
        name=names.dlq_stream,
        description="jetllm dead letters: jobs that could not be served, with the reason",
        subjects=[names.dlq_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage,
        num_replicas=replicas,
        max_age=policy.setting("dlq_max_age"),
        duplicate_window=policy.setting("duplicate_window"),
    )
    traces = StreamConfig(
        name=names.traces_stream,
        description="jetllm traces: one timing record per worker hop of a request",
        subjects=[names.trace_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage,
        num_replicas=replicas,
        max_age=policy.setting("results_max_age"),
        max_msgs_per_subject=64,
        discard=DiscardPolicy.OLD,
    )
    await _ensure_streams(
        js,
        [
            Wanted(jobs, _named(policy, max_age="max_age", duplicate_window="duplicate_window")),
            Wanted(dead_letters, _named(policy, max_age="dlq_max_age", duplicate_window="duplicate_window")),
            _requests_stream(names, policy, replicas),
            _cancels_stream(names, policy, replicas),
            Wanted(traces, _named(policy, max_age="results_max_age")),
            _kv_events_stream(names, policy, replicas),
        ],
        rescale=rescale,
    )
    if rescale:
        await _rescale_buckets(js, names, replicas)


async def ensure_kv_events_stream(js: JetStreamContext, names: Names, policy: QueuePolicy) -> None:
    replicas = policy.replicas or await namespace_replicas(js, names)
    await _ensure_stream(js, _kv_events_stream(names, policy, replicas), rescale=policy.replicas is not None)


def _kv_events_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.kv_events_stream,
        description="jetllm KV-cache events: one subject per (model, instance), replayable",
        subjects=[names.kv_events_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY if policy.memory else StorageType.FILE,
        num_replicas=replicas,
        max_age=policy.setting("kv_events_max_age"),
        max_msgs_per_subject=policy.setting("kv_events_max_msgs_per_subject"),
        duplicate_window=min(policy.setting("duplicate_window"), 120.0),
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )
    owned = _named(
        policy,
        max_age="kv_events_max_age",
        max_msgs_per_subject="kv_events_max_msgs_per_subject",
        duplicate_window="duplicate_window",
    )
    return Wanted(config, owned)


async def ensure_kv_blocks_stream(
    js: JetStreamContext, names: Names, *, ttl: float, max_bytes: int, replicas: int = 1
) -> None:
    """Where prefill workers leave KV blocks for decode workers: in memory, forgotten after `ttl`,
    and refusing new blocks when `max_bytes` are held (a full store makes decode workers prefill
    locally; it never pushes out blocks someone is about to load)."""
    config = StreamConfig(
        name=names.kv_blocks_stream,
        description="jetllm KV blocks: one subject per prefill-to-decode transfer",
        subjects=[names.kv_blocks_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY,
        num_replicas=replicas,
        max_age=ttl,
        max_bytes=max_bytes,
        discard=DiscardPolicy.NEW,
        duplicate_window=min(ttl, 120.0),
        allow_direct=True,
    )
    await _ensure_stream(js, Wanted(config, ("max_age", "max_bytes", "duplicate_window")), rescale=True)


def _requests_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    """Results are kept `results_max_age`, and never less than a job may wait (`max_age`): a
    worker that pulls an old job must still find what became of it."""
    config = StreamConfig(
        name=names.requests_stream,
        description="jetllm request log: delivered tokens (for migration) and results",
        subjects=[names.request_log_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY if policy.memory else StorageType.FILE,
        num_replicas=replicas,
        max_age=max(policy.setting("results_max_age"), policy.setting("max_age")),
        duplicate_window=min(policy.setting("duplicate_window"), 120.0),
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )
    owned = _named(policy, max_age="results_max_age", duplicate_window="duplicate_window")
    return Wanted(config, owned, raised=_named(policy, max_age="max_age"))


def _cancels_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    """Producers' durable cancels, apart from the request log so that producers need not write it.
    One record per request suffices; it matters only while the job can still be pulled (max_age)."""
    config = StreamConfig(
        name=names.cancels_stream,
        description="jetllm durable cancels: a job cancelled while queued is dropped unrun",
        subjects=[names.cancelled_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY if policy.memory else StorageType.FILE,
        num_replicas=replicas,
        max_age=policy.setting("max_age"),
        max_msgs_per_subject=1,
        duplicate_window=min(policy.setting("duplicate_window"), 120.0),
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )
    return Wanted(config, _named(policy, max_age="max_age", duplicate_window="duplicate_window"))


async def ensure_batch_plane(
    js: JetStreamContext,
    names: Names,
    *,
    ack_wait: float,
    replicas: int | None = None,
    memory: bool = False,
) -> tuple[ObjectStore, KeyValue]:
    """The OpenAI files and batches of a namespace: the files store, the bucket of batch states,
    and the work-queue stream of batches to run with its one consumer, shared by every runner.
    Batches are re-delivered after `ack_wait` seconds without a sign of life from their runner,
    for as long as it takes (a batch fails on its own terms, never by running out of deliveries)."""
    replicas = replicas or await namespace_replicas(js, names)
    storage = StorageType.MEMORY if memory else StorageType.FILE
    files = await ensure_bucket(
        js,
        ObjectStoreConfig(
            bucket=names.files_store,
            description="jetllm files: inputs and outputs of OpenAI-style batches",
            storage=storage,
            replicas=replicas,
        ),
    )
    state = await ensure_bucket(
        js,
        KeyValueConfig(
            bucket=names.batches_bucket,
            description="jetllm batches: status, counts and files of each batch (b.<batch>)",
            history=1,
            storage=storage,
            replicas=replicas,
        ),
    )
    await _ensure_stream(
        js,
        Wanted(
            StreamConfig(
                name=names.batch_queue_stream,
                description="jetllm batches to run: one message per batch, taken by one runner at a time",
                subjects=[names.batch_queue_all],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=storage,
                num_replicas=replicas,
                duplicate_window=120.0,
            )
        ),
        rescale=False,
    )
    config = ConsumerConfig(
        durable_name=names.BATCH_RUNNERS,
        description="jetllm batch runners",
        filter_subject=names.batch_queue_all,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=-1,
        num_replicas=0,
    )
    try:
        await api_call(
            lambda: js.add_consumer(names.batch_queue_stream, config), "creating the batch consumer"
        )
    except nats.js.errors.APIError:  # it exists with other settings (another ack_wait): use it as it is
        await js.consumer_info(names.batch_queue_stream, names.BATCH_RUNNERS)
    return files, state


async def ensure_routing_stream(js: JetStreamContext, names: Names, policy: QueuePolicy) -> None:
    """The routing queue (docs/routing.md): made by routers (and by the producers that use them,
    where they may), so a namespace without a router fleet has no stream nobody reads."""
    replicas = policy.replicas or await namespace_replicas(js, names)
    routing = StreamConfig(
        name=names.routing_stream,
        description="jetllm routing queue: jobs a router fleet places on an instance or the shared queue",
        subjects=[names.routing_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.MEMORY if policy.memory else StorageType.FILE,
        num_replicas=replicas,
        max_age=policy.setting("max_age"),
        duplicate_window=policy.setting("duplicate_window"),
        discard=DiscardPolicy.OLD,
    )
    await _ensure_streams(js, [Wanted(routing)], rescale=policy.replicas is not None, maker="a router")
