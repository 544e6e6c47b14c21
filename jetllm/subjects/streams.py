"""What each stream and bucket of a namespace looks like: configs built from its names and one
side's policy, with no I/O (setup.py creates or updates them).

A stream comes as a `Wanted` (streamupdate.py): its config and the fields this side owns, the
settings its policy named; an existing stream is changed only in those. Storage follows the
policy's `memory`; replicas are decided by setup.py and passed in.
"""

from __future__ import annotations

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
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from .names import Names
from .policy import QueuePolicy
from .streamupdate import Wanted

RECORD_TTL = 10.0
"""Seconds a registry record outlives its last heartbeat in the bucket (the bound after a SIGKILL)."""

DEDUP_CAP_S = 120.0
"""The longest duplicate window of the streams besides the jobs stream and the dead letters: their
writers retry a publish within seconds."""


def _named(policy: QueuePolicy, **fields: str) -> tuple[str, ...]:
    """The stream config fields (keys) whose policy setting (value) this side chose."""
    return tuple(cfg for cfg, setting in fields.items() if getattr(policy, setting) is not None)


def storage(memory: bool) -> StorageType:
    return StorageType.MEMORY if memory else StorageType.FILE


def namespace_streams(names: Names, policy: QueuePolicy, replicas: int) -> list[Wanted]:
    """Every stream each worker and producer keeps (`ensure_streams`), the jobs stream first."""
    return [
        jobs_stream(names, policy, replicas),
        dead_letters_stream(names, policy, replicas),
        requests_stream(names, policy, replicas),
        cancels_stream(names, policy, replicas),
        traces_stream(names, policy, replicas),
        kv_events_stream(names, policy, replicas),
    ]


def jobs_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.jobs_stream,
        description="jetllm jobs: one shared durable pull consumer per (role, model)",
        subjects=[names.jobs_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=policy.setting("max_age"),
        duplicate_window=policy.setting("duplicate_window"),
        discard=DiscardPolicy.OLD,
    )
    return Wanted(config, _named(policy, max_age="max_age", duplicate_window="duplicate_window"))


def dead_letters_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.dlq_stream,
        description="jetllm dead letters: jobs that could not be served, with the reason",
        subjects=[names.dlq_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=policy.setting("dlq_max_age"),
        duplicate_window=policy.setting("duplicate_window"),
    )
    return Wanted(config, _named(policy, max_age="dlq_max_age", duplicate_window="duplicate_window"))


def traces_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.traces_stream,
        description="jetllm traces: one timing record per worker hop of a request",
        subjects=[names.trace_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=policy.setting("results_max_age"),
        max_msgs_per_subject=64,
        discard=DiscardPolicy.OLD,
    )
    return Wanted(config, _named(policy, max_age="results_max_age"))


def requests_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    """Results are kept `results_max_age`, and never less than a job may wait (`max_age`): a
    worker that pulls an old job must still find what became of it. A result rolls its subject up
    (the request's earlier records go as it is stored: workers/requestlog.py)."""
    config = StreamConfig(
        name=names.requests_stream,
        description="jetllm request log: delivered tokens (for migration) and results",
        subjects=[names.request_log_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=max(policy.setting("results_max_age"), policy.setting("max_age")),
        duplicate_window=min(policy.setting("duplicate_window"), DEDUP_CAP_S),
        discard=DiscardPolicy.OLD,
        allow_direct=True,
        allow_rollup_hdrs=True,
    )
    owned = _named(policy, max_age="results_max_age", duplicate_window="duplicate_window")
    return Wanted(config, owned, raised=_named(policy, max_age="max_age"))


def cancels_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    """Producers' durable cancels, apart from the request log so that producers need not write it.
    One record per request suffices; it matters only while the job can still be pulled (max_age)."""
    config = StreamConfig(
        name=names.cancels_stream,
        description="jetllm durable cancels: a job cancelled while queued is dropped unrun",
        subjects=[names.cancelled_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=policy.setting("max_age"),
        max_msgs_per_subject=1,
        duplicate_window=min(policy.setting("duplicate_window"), DEDUP_CAP_S),
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    )
    return Wanted(config, _named(policy, max_age="max_age", duplicate_window="duplicate_window"))


def kv_events_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.kv_events_stream,
        description="jetllm KV-cache events: one subject per (model, instance), replayable",
        subjects=[names.kv_events_all],
        retention=RetentionPolicy.LIMITS,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=policy.setting("kv_events_max_age"),
        max_msgs_per_subject=policy.setting("kv_events_max_msgs_per_subject"),
        duplicate_window=min(policy.setting("duplicate_window"), DEDUP_CAP_S),
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


def routing_stream(names: Names, policy: QueuePolicy, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.routing_stream,
        description="jetllm routing queue: jobs a router fleet places on an instance or the shared queue",
        subjects=[names.routing_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage(policy.memory),
        num_replicas=replicas,
        max_age=policy.setting("max_age"),
        duplicate_window=policy.setting("duplicate_window"),
        discard=DiscardPolicy.OLD,
    )
    return Wanted(config)


def kv_blocks_stream(names: Names, *, ttl: float, max_bytes: int, replicas: int) -> Wanted:
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
        duplicate_window=min(ttl, DEDUP_CAP_S),
        allow_direct=True,
    )
    return Wanted(config, ("max_age", "max_bytes", "duplicate_window"))


def registry_bucket(names: Names, replicas: int) -> KeyValueConfig:
    """Workers write it, producers and operators read it."""
    return KeyValueConfig(
        bucket=names.registry_bucket,
        description="jetllm registry: live instances (i.*) and model cards (m.*)",
        history=1,
        ttl=RECORD_TTL,
        storage=StorageType.FILE,
        replicas=replicas,
        limit_marker_ttl=RECORD_TTL,
    )


def lora_bucket(names: Names, replicas: int) -> KeyValueConfig:
    """The adapters each model should serve: producers write them, workers follow them."""
    return KeyValueConfig(
        bucket=names.lora_bucket,
        description="jetllm: LoRA adapters each model should serve",
        history=5,
        storage=StorageType.FILE,
        replicas=replicas,
    )


def files_store(names: Names, memory: bool, replicas: int) -> ObjectStoreConfig:
    return ObjectStoreConfig(
        bucket=names.files_store,
        description="jetllm files: inputs and outputs of OpenAI-style batches",
        storage=storage(memory),
        replicas=replicas,
    )


def batches_bucket(names: Names, memory: bool, replicas: int) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=names.batches_bucket,
        description="jetllm batches: status, counts and files of each batch (b.<batch>)",
        history=1,
        storage=storage(memory),
        replicas=replicas,
    )


def batch_queue_stream(names: Names, memory: bool, replicas: int) -> Wanted:
    config = StreamConfig(
        name=names.batch_queue_stream,
        description="jetllm batches to run: one message per batch, taken by one runner at a time",
        subjects=[names.batch_queue_all],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage(memory),
        num_replicas=replicas,
        duplicate_window=DEDUP_CAP_S,
    )
    return Wanted(config)


def batch_runners(names: Names, ack_wait: float) -> ConsumerConfig:
    """The one consumer every batch runner shares. A batch is re-delivered after `ack_wait` seconds
    without a sign of life from its runner, for as long as it takes (a batch fails on its own
    terms, never by running out of deliveries)."""
    return ConsumerConfig(
        durable_name=names.BATCH_RUNNERS,
        description="jetllm batch runners",
        filter_subject=names.batch_queue_all,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait,
        max_deliver=-1,
        num_replicas=0,
    )


def bucket_streams(names: Names) -> tuple[str, ...]:
    """The streams behind the namespace's buckets and object stores (and the batch queue), which a
    side that names replicas rescales with the others."""
    return (
        f"KV_{names.registry_bucket}",
        f"KV_{names.lora_bucket}",
        OBJ_STREAM_TEMPLATE.format(bucket=names.adapters_store),
        OBJ_STREAM_TEMPLATE.format(bucket=names.embeds_store),
        OBJ_STREAM_TEMPLATE.format(bucket=names.files_store),
        f"KV_{names.batches_bucket}",
        names.batch_queue_stream,
    )
