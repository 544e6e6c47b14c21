"""What a worker needs from an engine, in jetllm's own terms.

The role modules speak only this protocol, so the message plane can be exercised with a light
test engine, and vLLM specifics (SamplingParams, RequestOutput, its exceptions) stay in one
adapter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from ...schemas import FinishReason, GenerateRequest, Prompt


class KvEventSource(msgspec.Struct, kw_only=True):
    """One engine publisher of KV-cache events: vLLM's ZMQ PUB socket and its replay socket."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class EngineFacts(msgspec.Struct, kw_only=True):
    model: str
    """The name jobs use for this model (vLLM's served_model_name)."""
    max_model_len: int
    block_size: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    vocab_size: int | None = None
    eos_token_ids: list[int] = []
    """Token ids that end a sequence unless ignore_eos (from the tokenizer and generation config)."""
    engine: str = ""
    """Which engine and version, for status reports."""
    source: str = ""
    """Where the weights came from, for the model card: a hub id or a directory's name."""
    chat_template: bool = False
    kv_events: dict[int, KvEventSource] = {}
    """Per data-parallel rank, where the engine publishes KV-cache events; empty: it does not."""


class ChoiceDelta(msgspec.Struct, kw_only=True):
    index: int
    token_ids: list[int]
    text: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class EngineStep(msgspec.Struct, kw_only=True):
    """New output of one request since the previous step."""

    choices: list[ChoiceDelta]
    finished: bool
    cached_tokens: int = 0


class EngineLoad(msgspec.Struct, kw_only=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    """Fraction of KV-cache blocks in use, when the engine reports it."""
    unfinished: int = 0
    """Requests the engine's front end still tracks."""


class Engine(Protocol):
    facts: EngineFacts

    async def render(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (chat template applied). Raises RequestRejected."""
        ...

    def generate(
        self, req: GenerateRequest, prompt_ids: list[int], max_tokens: int
    ) -> AsyncIterator[EngineStep]:
        """Run one request. Cancelling the iteration aborts it inside the engine.

        Raises RequestRejected (bad parameters), EngineRequestError (this request failed),
        EngineDead (nothing more will run).
        """
        ...

    async def check_health(self) -> None:
        """Raises EngineDead when the engine can no longer serve."""
        ...

    def load(self) -> EngineLoad: ...

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks; False when the engine refused (blocks still in use)."""
        ...

    async def sleep(self, level: int) -> str:
        """Stop scheduling, free what the platform can; returns what was done, in plain words.
        Call only with no request running."""
        ...

    async def wake(self) -> None: ...

    async def close(self) -> None: ...
