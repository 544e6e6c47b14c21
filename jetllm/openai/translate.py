"""OpenAI request bodies to jetllm jobs, and jetllm's field paths back to OpenAI's parameter names.

Pure functions: the endpoints call them, the tests table them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..schemas import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    InstanceRecord,
    OutputOptions,
    Prompt,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
    TextPrompt,
    TokensPrompt,
    ToolCall,
    ToolCallFunction,
)
from ..subjects import codec
from . import structured, tools
from .bodies import ChatRequest, CompletionRequest, Message, _Generation
from .errors import invalid

MAX_PROMPTS = 256
"""Prompts in one completions request: each is a job queued at once and followed by a task of the
gateway, and the request is admitted against `--max-queue` as a whole. More belong in a batch."""

UNSTREAMED_INTERVAL = 64
"""Tokens per frame for a request answered in one piece (`stream` false): nobody reads the
tokens before the end, so the worker sends them in few frames (OutputOptions.stream_interval)."""

_AT = re.compile(r"^(.*) - at `(\$[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")

_COMMON_PARAMS = {
    "$.sampling.": "",
    "$.stop.": "",
    "$.structured": "response_format",
    "$.adapter": "model",
    "$.model": "model",
    "$.prompt.messages": "messages",
    "$.prompt.tools": "tools",
    "$.prompt.template_kwargs": "chat_template_kwargs",
}


@dataclass(frozen=True)
class Route:
    """Where a request's model runs: the served model, and the adapter when the name was one."""

    model: str
    adapter: str | None = None


def served_route(name: str, records: Iterable[InstanceRecord]) -> Route | None:
    """Where a request's `model` runs now, for the gateway and the batch runner alike: a model a
    serving worker has is its own; an adapter loaded on one runs on that base model. None when no
    serving worker has it."""
    live = [r for r in records if r.state == "serving" and r.ready]
    if any(r.model == name for r in live):
        return Route(name)
    return next((Route(r.model, name) for r in live if name in r.adapters), None)


@dataclass
class Job:
    """A translated request: the job, how its parameters are named in the request, how tool
    calls are read back."""

    request: GenerateRequest
    params: dict[str, str] = field(default_factory=dict)
    """Wire field prefix -> the request's parameter, on top of the shared table."""
    tool_plan: tools.ToolPlan = tools.ToolPlan("none")


def param_of(path: str | None, params: dict[str, str]) -> str | None:
    """The request parameter a jetllm field path (`$.sampling.temperature`) stands for."""
    if not path:
        return None
    table = {**_COMMON_PARAMS, **params}
    for prefix in sorted(table, key=len, reverse=True):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix) :]
        if rest and not prefix.endswith(".") and rest[0] not in ".[":
            continue  # `$.stop.max_tokens` is not a prefix of `$.stop.max_tokens_x`
        return table[prefix] + rest if table[prefix] else rest
    return path.removeprefix("$.")


_DECODERS: dict[Any, codec.Decoder] = {}
_WIRE = codec.Decoder(GenerateRequest)
_ANY = codec.Decoder(Any)


def decode(body: bytes, kind: type[Any]) -> Any:
    """The body as `kind`; a body that is not JSON (invalid UTF-8 and too deep nesting included), or
    a field of the wrong type, is a 400 naming it."""
    decoder = _DECODERS.get(kind) or _DECODERS.setdefault(kind, codec.Decoder(kind))
    try:
        return decoder.decode(body, "json")
    except msgspec.ValidationError as exc:
        message = str(exc)
        m = _AT.match(message)
        what, at = (m.group(1), m.group(2)) if m else (message, "$")
        param = at.removeprefix("$").removeprefix(".")
        missing = _MISSING.match(what)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise invalid(f"{param}: {what}" if param else what, param or None) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"the body is not a JSON object: {exc}", None) from None


def validated(job: Job) -> GenerateRequest:
    """The job as a worker would decode it: every range and pattern checked here, so a bad value
    is a 400 naming the request's parameter before anything is queued."""
    try:
        return _WIRE.decode(msgspec.msgpack.encode(job.request))
    except msgspec.ValidationError as exc:
        message = str(exc)
        m = _AT.match(message)
        if m is None:
            raise invalid(message, None) from None
        param = param_of(m.group(2), job.params)
        raise invalid(f"{param}: {m.group(1)}", param) from None
    except (OverflowError, RecursionError, msgspec.DecodeError):
        path, why = _uncarried(job.request)
        param = param_of(path, job.params)
        raise invalid(f"{param or 'the request'} {why}", param) from None


def _uncarried(request: GenerateRequest) -> tuple[str | None, str]:
    """Which free-form part of the job (JSON the body structs do not type) the wire cannot carry,
    and why: typed fields are bounded when the body is decoded, these only here."""
    prompt = request.prompt
    parts = {
        "$.prompt.token_ids": getattr(prompt, "token_ids", None),
        "$.prompt.template_kwargs": getattr(prompt, "template_kwargs", None),
        "$.prompt.tools": getattr(prompt, "tools", None),
        "$.structured": request.structured,
    }
    for path, value in parts.items():
        try:
            _ANY.decode(msgspec.msgpack.encode(value))
        except OverflowError:
            return path, "holds an integer outside the 64-bit range; send a smaller one"
        except (RecursionError, msgspec.DecodeError):
            return path, "nests too deeply; flatten it"
    return None, "cannot be encoded as a job (an integer outside 64 bits, or too deep nesting)"


def _sampling(body: _Generation) -> SamplingOptions:
    return SamplingOptions(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        n=body.n,
    )


def _stop(body: _Generation, max_tokens: int | None) -> StopConditions:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return StopConditions(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def _refuse_unsupported(body: _Generation) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of is not supported (only best_of equal to n)", "best_of")
    if body.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")


def _content(m: Message, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise invalid(
                f"messages[{i}].content[{j}] is of type {part.type!r}; only text parts are supported",
                f"messages[{i}].content[{j}].type",
            )
        texts.append(part.text)
    return "".join(texts)


def _message(m: Message, i: int) -> ChatMessage:
    calls = None
    if m.tool_calls:
        calls = [
            ToolCall(id=c.id, function=ToolCallFunction(name=c.function.name, arguments=c.function.arguments))
            for c in m.tool_calls
        ]
    return ChatMessage(role=m.role, content=_content(m, i), tool_calls=calls, tool_call_id=m.tool_call_id)


def _output_constraint(
    body: _Generation, tool_constraint: StructuredOutput | None
) -> tuple[str, StructuredOutput] | None:
    asked = structured.constraint(body)
    if tool_constraint is None:
        return asked
    if asked is not None:
        raise invalid(f"tool_choice and {asked[0]} both constrain the output; give one of them", asked[0])
    return "tool_choice", tool_constraint


def chat_job(body: ChatRequest, route: Route, request_id: str) -> Job:
    _refuse_unsupported(body)
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    tool_plan = tools.plan(body.tools, body.tool_choice)
    tool_specs = tools.specs(body.tools) if body.tools else None
    constraint = _output_constraint(body, tool_plan.constraint)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = {
        "$.output.logprobs": "top_logprobs",
        "$.prompt": "messages",
        "$.stop.max_tokens": "max_completion_tokens"
        if body.max_completion_tokens is not None
        else "max_tokens",
    }
    if constraint is not None:
        params["$.structured"] = constraint[0]
    prompt = ChatPrompt(
        messages=[_message(m, i) for i, m in enumerate(body.messages)],
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
        tools=tool_specs,
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    job = Job(
        _job(body, route, request_id, prompt, max_tokens, logprobs, constraint),
        params,
        tool_plan,
    )
    job.request = validated(job)
    return job


def completion_prompts(prompt: str | list[Any]) -> list[Prompt]:
    """One jetllm prompt per prompt of the request: text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [TextPrompt(text=prompt)]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [TokensPrompt(token_ids=list(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise invalid(
            f"prompt holds {len(prompt)} prompts; a request takes at most {MAX_PROMPTS}: "
            "split it into several requests, or send them as a batch",
            "prompt",
        )
    out: list[Prompt] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(TextPrompt(text=p))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(TokensPrompt(token_ids=p))
        else:
            raise invalid(f"prompt[{i}] must be a string or a non-empty list of token ids", f"prompt[{i}]")
    return out


def completion_jobs(body: CompletionRequest, route: Route, request_id: str) -> list[Job]:
    """One job per prompt; with several prompts, choice indexes run prompt by prompt (as OpenAI's)."""
    _refuse_unsupported(body)
    if body.echo:
        raise invalid("echo is not supported", "echo")
    if body.suffix is not None:
        raise invalid("suffix is not supported", "suffix")
    constraint = _output_constraint(body, None)
    params = {
        "$.output.logprobs": "logprobs",
        "$.prompt": "prompt",
        "$.prompt.text": "prompt",
        "$.prompt.token_ids": "prompt",
    }
    if constraint is not None:
        params["$.structured"] = constraint[0]
    prompts = completion_prompts(body.prompt)
    jobs = []
    for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        job = Job(_job(body, route, rid, prompt, body.max_tokens, body.logprobs, constraint), params)
        job.request = validated(job)
        jobs.append(job)
    return jobs


def _job(
    body: _Generation,
    route: Route,
    request_id: str,
    prompt: Prompt,
    max_tokens: int | None,
    logprobs: int | None,
    constraint: tuple[str, StructuredOutput] | None,
) -> GenerateRequest:
    # as vLLM's server: token prompts answer in text too
    text = True if isinstance(prompt, TokensPrompt) else None
    output = OutputOptions(
        text=text,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        stream_interval=None if body.stream else UNSTREAMED_INTERVAL,
    )
    return GenerateRequest(
        request_id=request_id,
        model=route.model,
        adapter=route.adapter,
        prompt=prompt,
        sampling=_sampling(body),
        stop=_stop(body, max_tokens),
        output=output,
        structured=constraint[1] if constraint else None,
    )
