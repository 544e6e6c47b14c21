"""OpenAI's request bodies, as the gateway reads them.

Fields the gateway does not know are ignored, as OpenAI's own server ignores them (clients send
vendor extras freely); a known field of the wrong type is a 400 naming it. Only fields that change
what is generated are here, plus those that must be refused rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Int = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
"""An integer field: JSON has no bound, the wire (msgpack) and vLLM's `seed` are 64-bit, so a
bigger one is a 400 naming its field rather than a failure to encode the job."""


class _Body(msgspec.Struct, kw_only=True):
    """Unknown fields are skipped (msgspec's default for a struct)."""


class TextPart(_Body, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(_Body, kw_only=True):
    name: str
    arguments: str = ""


class MessageToolCall(_Body, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class Message(_Body, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(_Body, kw_only=True):
    name: str


class NamedToolChoice(_Body, kw_only=True):
    type: str = "function"
    function: NamedFunction


class JsonSchemaFormat(_Body, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(_Body, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body, kw_only=True):
    """vLLM's `structured_outputs` extra: exactly one of these is set."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False


class _Generation(_Body, kw_only=True):
    """What both endpoints share: sampling, stopping, streaming and vLLM's extras."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    best_of: Int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatRequest(_Generation, kw_only=True):
    messages: list[Message]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[Any]
    """Text, token ids, or a list of either (several prompts); translate.py tells them apart."""
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False
    """vLLM's extra: each choice (each streamed chunk) also carries its token ids."""
