"""A generate job: the prompt in one of three forms, and how to sample and stop."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .common import Command, Strict

RequestId = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9._:=/+-]{1,200}$",
        description="Unique per job; also the JetStream dedupe id (Nats-Msg-Id).",
    ),
]
TokenId = Annotated[int, Meta(ge=0)]


ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class ToolCallFunction(Strict, kw_only=True):
    name: ToolName
    arguments: str
    """The arguments as the model wrote them: a JSON document, as text."""


class ToolCall(Strict, kw_only=True):
    """A tool call an assistant message made earlier in the conversation (OpenAI's shape)."""

    id: Annotated[str, Meta(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict, kw_only=True, omit_defaults=True):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    """system, user, assistant, tool, ... whatever the model's template knows."""
    content: str
    tool_calls: list[ToolCall] | None = None
    """An assistant message's calls of tools, given back to the template in later turns."""
    tool_call_id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    """A tool message's answer to this call."""


class ToolFunction(Strict, kw_only=True, omit_defaults=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON schema of the arguments."""


class ToolSpec(Strict, kw_only=True):
    """A tool the model may call, rendered into the prompt by the model's chat template (OpenAI's shape)."""

    type: Literal["function"] = "function"
    function: ToolFunction


class TokensPrompt(Strict, tag="tokens", tag_field="type"):
    """Token ids, sent to the engine as they are (no template, no special tokens added)."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1)]


class ChatPrompt(Strict, tag="chat", tag_field="type", omit_defaults=True):
    """OpenAI-style messages, rendered on the worker with the model's chat template."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    add_generation_prompt: bool = True
    """End the rendered prompt with the assistant's turn opener (what chat completions do)."""
    continue_final_message: bool = False
    """Let the model continue the last message instead of starting a new one."""
    template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. `enable_thinking`)."""
    tools: Annotated[list[ToolSpec], Meta(max_length=128)] | None = None
    """Tools the template describes to the model (its `tools` variable); the model's calls come
    back as text, which the caller parses (the gateway reads Hermes-style `<tool_call>` blocks)."""


class TextPrompt(Strict, tag="text", tag_field="type"):
    """Plain text, tokenized on the worker the way vLLM's completions endpoint does."""

    text: Annotated[str, Meta(min_length=1)]


EmbedsDtype = Literal["float32", "float16", "bfloat16"]


class EmbedsPrompt(Strict, tag="embeds", tag_field="type", kw_only=True):
    """Precomputed input embeddings, one row per prompt position, fed to the model in place of
    its token embeddings. Raw little-endian bytes in row-major order, never a pickled tensor.

    Exactly one of `data` (inline) and `object` (too big for one NATS message) is set.
    """

    dtype: EmbedsDtype
    """Element type of the bytes; the engine converts to the model's dtype."""
    shape: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1, max_length=8)]
    """`[rows, hidden]`: rows count as prompt tokens; hidden must equal the model's hidden size."""
    data: bytes | None = None
    """The tensor: rows * hidden * itemsize bytes (msgpack bin; base64 in JSON)."""
    object: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    """Name of an object holding the bytes in the namespace's embeddings object store."""
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")] | None = None
    """Hex SHA-256 of the object's bytes; required with `object`, checked before use."""


Prompt = TokensPrompt | ChatPrompt | TextPrompt | EmbedsPrompt


class SamplingOptions(Strict, kw_only=True, omit_defaults=True):
    """None means the model's default (its generation_config), else vLLM's default."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    """Per-request seed: the same seed, prompt and parameters give the same tokens."""
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=64)] = 1
    """Independent choices for the prompt; needs temperature > 0."""


class StopConditions(Strict, kw_only=True, omit_defaults=True):
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    """None: the room left in the context after the prompt."""
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    """EOS and stop conditions are ignored until this many tokens were generated."""
    stop: list[Annotated[str, Meta(min_length=1)]] = []
    """Stop strings; the matched string is cut from the text unless include_stop_str_in_output."""
    stop_token_ids: list[TokenId] = []
    """Token ids that end the choice (the id itself is part of the output)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    include_stop_str_in_output: bool = False


class OutputOptions(Strict, kw_only=True, omit_defaults=True):
    text: bool | None = None
    """Send text deltas. None: yes for chat and text prompts, no for token and embeddings prompts."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Log-probability of each sampled token, plus this many top alternatives."""
    skip_special_tokens: bool = True
    """Leave special tokens (BOS, EOS, ...) out of the text."""
    stream_interval: Annotated[int, Meta(ge=1, le=4096)] | None = None
    """Tokens per frame: the engine hands over a choice's tokens every this many (its first and
    its last at once), so the worker and the producer spend less per token. None: every engine
    step for a job with `reply_to`; every 32 tokens for a detached job, which nobody watches (a
    worker that dies regenerates at most that many tokens nobody saw)."""


JsonValue = Any


class JsonSchemaOutput(Strict, tag="json_schema", tag_field="type"):
    """Output is one JSON document that validates against `json_schema` (OpenAI's
    `response_format: {"type": "json_schema"}`)."""

    json_schema: dict[str, JsonValue]


class JsonObjectOutput(Strict, tag="json_object", tag_field="type"):
    """Output is one JSON object, of any shape (OpenAI's `response_format: {"type": "json_object"}`)."""


class RegexOutput(Strict, tag="regex", tag_field="type"):
    """Output matches the regular expression `pattern` from its start to its end."""

    pattern: Annotated[str, Meta(min_length=1, max_length=16384)]


class ChoiceOutput(Strict, tag="choice", tag_field="type"):
    """Output is exactly one of `choices`."""

    choices: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1, max_length=1024)]


class GrammarOutput(Strict, tag="grammar", tag_field="type"):
    """Output is a sentence of the context-free `grammar` (EBNF/GBNF or Lark, as vLLM's
    structured-output backends read it)."""

    grammar: Annotated[str, Meta(min_length=1, max_length=65536)]


StructuredOutput = JsonSchemaOutput | JsonObjectOutput | RegexOutput | ChoiceOutput | GrammarOutput


class GenerateRequest(Command):
    """Published to `jetllm.<ns>.jobs.generate.<model>`; frames go to `reply_to`."""

    request_id: RequestId
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    """The served (base) model name; must match the job subject's model."""
    prompt: Prompt
    adapter: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    """Run with this LoRA adapter of the model (`jetllm lora load`); the job still goes to the
    base model's queue. An adapter the model does not have is an error, never the base model."""
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop: StopConditions = msgspec.field(default_factory=StopConditions)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    structured: StructuredOutput | None = None
    """Constrain every choice's tokens to a JSON schema, any JSON object, a regex, a fixed set of
    choices or a grammar. A constraint that does not compile is `invalid_request` naming this
    field; a migrated request continues under the same constraint."""
    reply_to: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    """Subject for the reply frames; None for a detached job (its result is still stored)."""
    session_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    """A conversation's id: a KV-aware router sends a session's jobs to the instance its last job
    went to when no instance holds any of the prompt (no KV events, or a cold cache)."""
    max_migrations: Annotated[int, Meta(ge=0, le=100)] | None = None
    """How often the request may move to another worker after a worker died under it;
    None: the worker's default (--max-migrations). Planned moves (a draining worker) are free."""


Encoding = Literal["msgpack", "json"]
