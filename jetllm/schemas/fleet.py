"""The fleet's shared view: instance records and model cards (registry KV bucket), load reports,
and the replies of control verbs (request/reply on per-instance and per-model subjects)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .common import Command, ErrorCode, Report, Tolerant

InstanceState = Literal["starting", "serving", "sleeping", "draining"]


class EngineInfo(Tolerant, kw_only=True):
    """Facts of the engine behind an instance that a router or operator plans with."""

    engine: str = ""
    block_size: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int = 0
    dp_size: int = 1


class InstanceRecord(Report, kw_only=True):
    """One live worker, under `i.<instance>` in the registry bucket; rewritten every heartbeat.

    Readers treat a record whose `heartbeat_at` is older than `expires_after` as dead even before
    the bucket's age limit removes it.
    """

    instance: str
    role: str
    model: str
    state: InstanceState
    adapters: list[str] = []
    """LoRA adapters loaded now; requests may name them as their model."""
    dp_ranks: list[int] = msgspec.field(default_factory=lambda: [0])
    """Data-parallel ranks this worker serves (events and metrics are per rank)."""
    engine: EngineInfo = msgspec.field(default_factory=EngineInfo)
    slots: int = 0
    in_flight: int = 0
    version: str = ""
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    expires_after: float = 0.0
    """Seconds after `heartbeat_at` when this record stops counting as alive."""
    metrics_url: str | None = None
    cached_blocks: int | None = None
    """Prefix-cache blocks the engine holds now, as its KV-event relay counts them (None: no relay)."""
    ready: bool = False
    """Consumer bound and engine answered: the worker can take jobs (false while sleeping)."""
    directed_queue: str | None = None
    """The job queue (a role name) whose jobs may be addressed to this instance: producers publish
    them to `jetllm.<ns>.jobs.<queue>.<model>.i.<instance>`. None: it pulls no directed jobs."""
    shard_lines: int = 0
    """It pulls the model's shard queue (`jetllm.<ns>.jobs.shard.<model>`, schemas/shard.py) while
    it has a free slot and no shard's requests beyond its slots, and wants shards of at most this
    many requests (those beyond its free slots wait in its engine's queue); 0: it takes no shards.
    A batch runner sends a model's lines as shards while its live workers take them."""


class ModelCard(Report, kw_only=True):
    """What a served model is, under `m.<model>` in the registry bucket (written by its workers)."""

    model: str
    source: str = ""
    """Where the weights came from (a directory name or hub id, never a full local path)."""
    max_model_len: int = 0
    vocab_size: int | None = None
    eos_token_ids: list[int] = []
    block_size: int | None = None
    chat_template: bool = False
    hidden_size: int | None = None
    """Width of the model's embeddings: the `hidden` an embeddings prompt must have."""
    prompt_embeds: bool = False
    """Whether its workers accept embeddings prompts (`--enable-prompt-embeds`)."""
    updated_at: float = 0.0


class LoadReport(Report, kw_only=True):
    """Published about once a second on `jetllm.<ns>.load.<model>.<instance>`: what a router weighs."""

    instance: str
    model: str
    dp_rank: int = 0
    at: float
    running: int
    waiting: int
    in_flight: int
    slots: int
    kv_usage: float | None = None
    """Fraction of KV-cache blocks in use (0..1), when the engine reports it."""
    num_kv_blocks: int | None = None
    state: InstanceState = "serving"


class Routed(Report, kw_only=True):
    """Published by a router on `jetllm.<ns>.routed.<role>.<model>` for every job it directs: the
    other routers count the prompt's blocks as held there too (router/pending.py), so a new
    prefix's jobs follow its first to one instance whichever router places them."""

    router: str
    """The router that placed it (each skips its own)."""
    instance: str
    blocks: list[int]
    """The prompt's chain of block hashes up to its last full block (router/hashing.py)."""


class ControlFailed(Report, kw_only=True, tag="failed"):
    """A control verb that could not be carried out on one instance."""

    instance: str
    code: ErrorCode
    message: str


class ControlDone(Report, kw_only=True, tag="done"):
    """A control verb carried out; `detail` says what it did, plainly."""

    instance: str
    verb: str
    detail: str = ""
    state: InstanceState | None = None


class TaskWait(Report, kw_only=True):
    """One asyncio task of a process and what it awaits."""

    name: str
    """The task's name: a job's tasks are `job <request id>`."""
    awaits: list[str] = []
    """Its chain of awaits, outermost first: `function (file:line)`, ending with the future it waits on."""


class TasksReport(Report, kw_only=True, tag="tasks"):
    """A worker's answer to `tasks`: where each of its tasks waits, as SIGUSR1 writes it to its log."""

    instance: str
    tasks: list[TaskWait] = []


class HealthReport(Report, kw_only=True, tag="health"):
    """A worker's answer on its health subject."""

    instance: str
    healthy: bool
    engine_alive: bool
    state: InstanceState
    canary_ok: bool | None = None
    """None when no canary ran (asked not to, or the worker is sleeping)."""
    canary_tokens: int = 0
    canary_latency_ms: float | None = None
    last_error: str | None = None
    checked_at: float = 0.0


class HealthCheck(Command, kw_only=True):
    """Asks for a HealthReport; `canary` runs a short greedy generation through the engine."""

    canary: bool = True
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    """Tokens the canary generates."""
    stall_timeout: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    """Fail the canary if no token arrives for this many seconds."""


class SleepRequest(Command, kw_only=True):
    """Body of the `sleep` verb (an empty body means level 1)."""

    level: int = 1
    """With sleep mode (GPU), both discard the KV cache; 1 moves the weights to CPU memory, 2 discards
    them (wake reloads them from disk). On CPU either only pauses scheduling."""
