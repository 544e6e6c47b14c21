"""What a role is: the part of a worker that knows one kind of job.

The runtime pulls, holds slots, settles, dead-letters and stops the same way for every kind of
job; a role says which queue it consumes, how its jobs decode, how one runs on the engine, what
its health canary is, what it reports in the registry and which CLI flags mean something for it.
It runs a job through a `JobHandle`, the narrow side of the job protocol (protocol.py): it asks
the handle to claim, accept, send tokens and finish, and never publishes a frame or settles a
job itself, so every role gets the protocol's guarantees (the log leads every frame, one terminal
frame, the fault barrier) without restating them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import msgspec

from ...schemas import (
    Choice,
    ChoiceLogprobs,
    GenerateRequest,
    HealthCheck,
    ModelCard,
    Result,
    TokensFrame,
    Usage,
)
from ...subjects import codec
from ..cachedblocks import CachedBlocks
from ..config import WorkerConfig
from ..context import WorkerContext
from ..embeds import EmbedsLoader
from ..engine import Engine, EngineAdapter
from ..requestlog import RequestLog

TokenSender = Callable[
    [int, list[int], "str | None", "list[float] | None", "list[dict[int, float]] | None"], Awaitable[None]
]
"""(choice index, token ids, text, logprobs, top logprobs): one tokens frame."""


class JobHandle(Protocol):
    """One delivery as a role sees it: its decoded request and the protocol's steps, in order
    claim -> accept -> tokens... -> finish (or answer_from / defer / cancelled instead)."""

    request: Any
    """What the role's `decode` returned."""
    request_id: str
    stage: str
    """What the worker is doing with the job now, for the message of an unexpected failure."""
    tokens: TokenSender
    """Sends one tokens frame (checkpointed in the log); the request's frames are numbered for the role."""
    prefill: str | None
    """Where the prompt was prefilled, for the trace (roles that choose set it)."""

    @property
    def attempt(self) -> int: ...

    @property
    def fresh(self) -> bool:
        """Whoever sent the job says the request most likely never ran (a fresh shard's first
        delivery, not cancelled as a whole): the role may `claim_first` instead of reading the log
        and the durable cancel, and read them only when that claim finds the log not empty."""

    def hold(self) -> None:
        """Token frames wait (unnumbered, unlogged) until `release()`: the request is not claimed yet."""

    def release(self) -> None: ...

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start a task beside the job (it must catch its own exceptions)."""

    async def claim(self, *, above: int = 0, supersede: bool = False) -> None:
        """Write the claim to the request log, numbering this attempt above `above` (the highest
        attempt that claimed it before); `supersede`: tell an older attempt still running to stop."""

    async def claim_first(self) -> bool:
        """Claim the request only if its log is empty (it never ran, was never cancelled in it):
        False, and nothing written, when it is not. For a `fresh` job, instead of reading the log."""

    async def delivered(self, after: int) -> list[TokensFrame]:
        """The token frames after seq `after` that the producer holds (the request log has them only
        up to its last checkpoint), recorded in the log; empty when nobody listens. Call it after
        `claim`: once the producer has answered, it drops frames of older attempts."""

    async def accept(
        self, *, replay: Sequence[TokensFrame] = (), last_seq: int = 0, resumed_tokens: int = 0
    ) -> None:
        """Send `replay` (token frames an earlier attempt delivered), then the accepted frame."""

    async def finish(
        self,
        choices: list[Choice],
        usage: Usage,
        *,
        token_ids: list[list[int]],
        text: list[str] | None = None,
        logprobs: list[ChoiceLogprobs] | None = None,
        migrations: int = 0,
    ) -> None:
        """Store the result, send the final frame, ack the job."""

    async def reply(self, message: msgspec.Struct, kind: str) -> None:
        """Instead of frames and a stored result: send the one answer its requester waits for
        (who keeps no log and redoes the work when none comes), and ack."""

    async def answer_from(self, result: Result) -> None:
        """The request already ended: answer from its stored result and ack."""

    async def defer(self, delay: float) -> None:
        """Leave the job to a worker that still runs it: hand it back after `delay` seconds."""

    def cancelled(self, reason: str) -> None:
        """The request was cancelled before it started: end it as cancelled."""


class Adapters(Protocol):
    def use(self, req: GenerateRequest) -> AbstractAsyncContextManager[EngineAdapter | None]: ...


@dataclass(frozen=True, slots=True)
class RoleDeps:
    """Everything a role may use; the composition root builds it once and every role gets the same."""

    ctx: WorkerContext
    engine: Engine
    log: RequestLog
    config: WorkerConfig
    adapters: Adapters
    """The engine adapter a request runs with (LoRA), held while it runs."""
    serves_adapter: Callable[[str], bool]
    """Whether this worker pulls the queue of an adapter of that name."""
    embeds: EmbedsLoader
    cached_blocks: CachedBlocks | None = None
    """The engine's prefix cache as its KV-cache events tell it, for roles that ask
    (`follows_cache`); None when the engine publishes no events."""


class Canary(msgspec.Struct, kw_only=True):
    """What one health canary found."""

    ok: bool
    tokens: int = 0
    ms: float = 0.0
    error: str | None = None


class Role(ABC):
    name: ClassVar[str]
    """`jetllm worker --role NAME`; what the registry and status replies call this worker."""
    queue: ClassVar[str]
    """The job queue consumed: `jetllm.<ns>.jobs.<queue>.<model>` (and one per loaded adapter).
    Queues are named by what the job asks for, so another role may consume the same queue."""
    flags: ClassVar[frozenset[str]] = frozenset()
    """CLI flags meaningful only for some roles that this one accepts (see roles/flags.py)."""
    follows_cache: ClassVar[bool] = False
    """Whether the role reads `RoleDeps.cached_blocks` (only then is it kept)."""
    takes_shards: ClassVar[bool] = False
    """Whether its workers also pull the model's shard queue (workers/shards.py): each request of
    a shard is then run by `run` as a job of its own; its job type must be `GenerateRequest`."""

    def __init__(self, deps: RoleDeps) -> None:
        self.facts = deps.engine.facts

    @abstractmethod
    def decode(self, data: bytes, headers: dict[str, str] | None) -> tuple[Any, codec.Encoding]:
        """The job's request and its encoding; raises jobs.RejectedJob naming what is wrong.
        The request has `request_id` and `reply_to` (every job does: see codec.JobEnvelope)."""

    @abstractmethod
    async def run(self, job: JobHandle) -> None:
        """Run one job on the engine through `job`. Raise RequestRejected / EngineRequestError
        to fail it with a typed error, LogUnavailable to have it wait, EngineDead when the engine
        died; anything else is a bug the fault barrier turns into an `internal` error."""

    @abstractmethod
    async def canary(self, check: HealthCheck) -> Canary:
        """A short piece of this role's work on the engine, for the `health` verb."""

    def model_card(self) -> ModelCard:
        """What the registry says about the served model (a producer plans its requests with it)."""
        f = self.facts
        return ModelCard(
            model=f.model,
            source=f.source,
            max_model_len=f.max_model_len,
            vocab_size=f.vocab_size,
            eos_token_ids=f.eos_token_ids,
            block_size=f.block_size,
            chat_template=f.chat_template,
            hidden_size=f.hidden_size,
            prompt_embeds=f.prompt_embeds,
            updated_at=time.time(),
        )
