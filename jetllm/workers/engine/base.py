"""What a worker needs from an engine, in jetllm's own terms.

The role modules speak only this protocol, so the message plane can be exercised with a light
test engine, and vLLM specifics (SamplingParams, RequestOutput, its exceptions) stay in one
adapter.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

import msgspec

from ...schemas import FinishReason, GenerateRequest, Prompt


class LoraFacts(msgspec.Struct, kw_only=True):
    """What an adapter must fit, checked before the engine sees it."""

    capacity: int
    """Adapters the engine holds at once (vLLM's max_cpu_loras); beyond it vLLM would evict one."""
    max_rank: int
    num_layers: int
    modules: dict[str, tuple[int, int]]
    """Target module -> (in features, out features) of the base layer it adapts."""
    base_names: list[str] = []
    """Names an adapter's `base_model_name_or_path` may give for this model."""


class EngineAdapter(msgspec.Struct, kw_only=True, frozen=True):
    """An adapter as the engine knows it: its engine-side name, id and verified local copy."""

    name: str
    id: int
    path: str


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
    prefix_hash_algo: str | None = None
    """vLLM's prefix_caching_hash_algo (how its block ids are made); None: no prefix caching."""
    max_num_seqs: int | None = None
    vocab_size: int | None = None
    eos_token_ids: list[int] = []
    """Token ids that end a sequence unless ignore_eos (from the tokenizer and generation config)."""
    engine: str = ""
    """Which engine and version, for status reports."""
    dp_ranks: list[int] = msgspec.field(default_factory=lambda: [0])
    """Data-parallel ranks this front end schedules onto (local and headless ones alike)."""
    source: str = ""
    """Where the weights came from, for the model card: a hub id or a directory's name."""
    chat_template: bool = False
    kv_events: dict[int, KvEventSource] = {}
    """Per data-parallel rank, where the engine publishes KV-cache events; empty: it does not."""
    lora: LoraFacts | None = None
    """None: the engine runs without LoRA."""
    hidden_size: int | None = None
    """Width of the model's input embeddings (what an embeddings prompt must match)."""
    prompt_embeds: bool = False
    """Whether the engine was started to accept embeddings prompts."""


class PromptEmbeds:
    """A checked embeddings prompt: `array` is a C-contiguous numpy array of shape (rows, hidden)
    (bfloat16 travels as its uint16 bit patterns, numpy having no bfloat16).

    `continuation` holds token ids generated after it, for a request that moves to another
    worker: the engine embeds those itself.
    """

    __slots__ = ("array", "dtype", "rows", "hidden", "continuation")

    def __init__(self, array: Any, dtype: str, continuation: list[int] | None = None) -> None:
        self.array = array
        self.dtype = dtype
        self.rows, self.hidden = int(array.shape[0]), int(array.shape[1])
        self.continuation = continuation or []

    def __len__(self) -> int:
        return self.rows + len(self.continuation)

    def then(self, token_ids: list[int]) -> PromptEmbeds:
        return PromptEmbeds(self.array, self.dtype, self.continuation + list(token_ids))


EnginePrompt = list[int] | PromptEmbeds
"""Token ids, or embeddings (for an `EmbedsPrompt`)."""


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
    kv_params: dict[str, Any] | None = None
    """What the engine's KV connector returned for another engine (vLLM's kv_transfer_params)."""


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
        self,
        req: GenerateRequest,
        prompt_ids: EnginePrompt,
        max_tokens: int,
        adapter: EngineAdapter | None = None,
        kv_transfer: dict[str, Any] | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        """Run one request (with a loaded adapter). Cancelling the iteration aborts it inside the engine.

        `kv_transfer`: what the engine's KV connector does for this request (kvtransfer/connector.py).

        Raises RequestRejected (bad parameters), EngineRequestError (this request failed),
        EngineDead (nothing more will run).
        """
        ...

    async def check_health(self) -> None:
        """Raises EngineDead when the engine can no longer serve."""
        ...

    def load(self) -> EngineLoad: ...

    def load_by_rank(self) -> dict[int, EngineLoad]:
        """The scheduler figures of each data-parallel rank."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks; False when the engine refused (blocks still in use)."""
        ...

    async def sleep(self, level: int) -> str:
        """Stop scheduling, free what the platform can; returns what was done, in plain words.
        Call only with no request running."""
        ...

    async def wake(self) -> None:
        """Undo `sleep`, whatever its level (reloading anything it discarded). A failed wake leaves
        the engine asleep, and calling it again starts over."""
        ...

    async def add_adapter(self, adapter: EngineAdapter) -> None:
        """Load a validated adapter; raises EngineRequestError if the engine refuses it."""
        ...

    async def remove_adapter(self, adapter_id: int) -> None: ...

    async def close(self) -> None: ...
