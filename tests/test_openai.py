"""OpenAI's API translated, tabled: bodies to jobs, field paths to parameters, tool calls read
back, ErrorCode to HTTP status, stream chunks; and the gateway's pure routing decisions."""

from __future__ import annotations

import json
import time

import msgspec
import pytest

from jetllm.gateway import capacity
from jetllm.openai import endpoints, stored, tools, translate
from jetllm.openai.bodies import ChatRequest, CompletionRequest, Message
from jetllm.openai.endpoints import CHAT, COMPLETIONS
from jetllm.openai.errors import STATUS, OpenAIError, from_code
from jetllm.openai.responses import Collected
from jetllm.openai.streams import ChatStream
from jetllm.schemas import (
    ChatPrompt,
    ChoiceLogprobs,
    ChoiceOutput,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    GrammarOutput,
    InstanceRecord,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    Result,
    TextPrompt,
    TokensFrame,
    TokensPrompt,
    Usage,
)
from jetllm.schemas.frames import Choice
from jetllm.workers.engine.chatmessages import template_message
from jetllm.workers.requestlog import keep_logprobs

ROUTE = translate.Route("m")
USER = [{"role": "user", "content": "hi"}]


def chat(**body) -> translate.Job:
    raw = msgspec.json.encode({"model": "m", "messages": USER, **body})
    return translate.chat_job(translate.decode(raw, ChatRequest), ROUTE, "r1")


def refused(**body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        chat(**body)
    return info.value


@pytest.mark.parametrize(
    ("body", "check"),
    [
        ({"max_tokens": 5}, lambda r: r.stop.max_tokens == 5),
        ({"max_tokens": 5, "max_completion_tokens": 7}, lambda r: r.stop.max_tokens == 7),
        ({"stop": "x"}, lambda r: r.stop.stop == ["x"]),
        ({"stop": ["x", "y"]}, lambda r: r.stop.stop == ["x", "y"]),
        ({"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1}, lambda r: r.sampling.top_k == 5),
        (
            {"repetition_penalty": 1.1, "presence_penalty": 1, "frequency_penalty": -1},
            lambda r: r.sampling.presence_penalty == 1,
        ),
        ({"seed": 7, "n": 3, "temperature": 1}, lambda r: (r.sampling.seed, r.sampling.n) == (7, 3)),
        ({"logprobs": True}, lambda r: r.output.logprobs == 0),
        ({"logprobs": True, "top_logprobs": 4}, lambda r: r.output.logprobs == 4),
        ({}, lambda r: r.output.logprobs is None and r.structured is None),
        ({"response_format": {"type": "text"}}, lambda r: r.structured is None),
        ({"response_format": {"type": "json_object"}}, lambda r: r.structured == JsonObjectOutput()),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "object"}},
                }
            },
            lambda r: r.structured == JsonSchemaOutput(json_schema={"type": "object"}),
        ),
        (
            {"guided_json": '{"type": "string"}'},
            lambda r: r.structured == JsonSchemaOutput(json_schema={"type": "string"}),
        ),
        ({"guided_regex": "a+"}, lambda r: r.structured == RegexOutput(pattern="a+")),
        ({"guided_choice": ["a", "b"]}, lambda r: r.structured == ChoiceOutput(choices=["a", "b"])),
        ({"guided_grammar": "root ::= 'a'"}, lambda r: r.structured == GrammarOutput(grammar="root ::= 'a'")),
        ({"structured_outputs": {"regex": "b+"}}, lambda r: r.structured == RegexOutput(pattern="b+")),
        ({"ignore_eos": True, "min_tokens": 2}, lambda r: r.stop.ignore_eos and r.stop.min_tokens == 2),
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            lambda r: r.prompt.template_kwargs == {"enable_thinking": False},
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ]
            },
            lambda r: r.prompt.messages[0].content == "ab",
        ),
        ({"unknown_field": {"deep": [1]}}, lambda r: r.model == "m"),
        ({}, lambda r: r.output.stream_interval == 64),  # answered in one piece: few frames
        ({"stream": True}, lambda r: r.output.stream_interval is None),  # every token as it comes
    ],
)
def test_chat_bodies_become_jobs(body, check):
    assert check(chat(**body).request)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": [""]}, "stop[0]"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ],
)
def test_bad_chat_bodies_name_the_parameter(body, param):
    err = refused(**body)
    assert (err.status, err.param) == (400, param), err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


BIG = 2**70
"""An integer JSON allows and msgpack (the wire) cannot carry."""
DEEP = "[" * 5000 + "]" * 5000
"""JSON nested deeper than any decoder's recursion limit."""
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _raw(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


@pytest.mark.parametrize(
    ("kind", "raw", "param", "says"),
    [
        (ChatRequest, _raw(messages=USER, seed=BIG), "seed", "<= 9223372036854775807"),
        (ChatRequest, _raw(messages=USER, n=BIG), "n", "<= 9223372036854775807"),
        (ChatRequest, _raw(messages=USER, max_tokens=BIG), "max_tokens", "<= 9223372036854775807"),
        (ChatRequest, _raw(messages=USER, top_k=-BIG), "top_k", ">= -9223372036854775808"),
        (ChatRequest, _raw(messages=USER, stop_token_ids=[1, BIG]), "stop_token_ids[1]", "<="),
        (
            ChatRequest,
            _raw(messages=USER, chat_template_kwargs={"a": [BIG]}),
            "chat_template_kwargs",
            "64-bit",
        ),
        (
            ChatRequest,
            _raw(messages=USER, tools=[{**TOOL, "function": {"name": "f", "parameters": {"maximum": BIG}}}]),
            "tools",
            "64-bit",
        ),
        (
            ChatRequest,
            _raw(
                messages=USER, response_format={"type": "json_schema", "json_schema": {"schema": {"x": BIG}}}
            ),
            "response_format",
            "64-bit",
        ),
        (ChatRequest, _raw(messages=USER, guided_json=json.dumps({"maximum": BIG})), "guided_json", "64-bit"),
        (ChatRequest, _raw(messages=USER, guided_json=DEEP), "guided_json", "nests too deeply"),
        (
            ChatRequest,
            _raw(messages=USER, structured_outputs={"json": DEEP}),
            "structured_outputs.json",
            "deep",
        ),
        (
            ChatRequest,
            _raw(messages=USER, chat_template_kwargs={"a": "DEEP"}).replace(b'"DEEP"', DEEP.encode()),
            None,
            "deep",
        ),
        (
            ChatRequest,
            _raw(messages=[{"role": "user", "content": "DATA"}]).replace(b"DATA", b"\xff"),
            None,
            "UTF-8",
        ),
        (CompletionRequest, _raw(prompt=[1, BIG]), "prompt", "64-bit"),
        (CompletionRequest, _raw(prompt=[[1], [BIG]]), "prompt", "64-bit"),
        (CompletionRequest, _raw(prompt="x", seed=BIG), "seed", "<= 9223372036854775807"),
        (CompletionRequest, _raw(prompt="x", logprobs=BIG), "logprobs", "<= 9223372036854775807"),
        (CompletionRequest, _raw(prompt=["a"] * (translate.MAX_PROMPTS + 1)), "prompt", "at most 256"),
    ],
)
def test_what_json_allows_and_a_job_cannot_carry_is_a_400_naming_it(kind, raw, param, says):
    """Big integers, deep nesting and invalid UTF-8: 400s in OpenAI's shape, never a crash."""
    with pytest.raises(OpenAIError) as info:
        body = translate.decode(raw, kind)
        if kind is ChatRequest:
            translate.chat_job(body, ROUTE, "r1")
        else:
            translate.completion_jobs(body, ROUTE, "r1")
    err = info.value
    assert (err.status, err.param, err.body()["error"]["type"]) == (400, param, "invalid_request_error")
    assert says in err.message and (param is None or err.message.startswith(param)), err.message


def test_free_form_json_nested_too_deeply_for_the_wire_is_a_400_naming_it():
    """Nesting the body's decoder took but encoding the job cannot (a deeper stack than decoding)."""
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    body = ChatRequest(
        model="m", messages=[Message(role="user", content="hi")], chat_template_kwargs={"a": deep}
    )
    with pytest.raises(OpenAIError) as info:
        translate.chat_job(body, ROUTE, "r1")
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs"), info.value.message
    assert "nests too deeply" in info.value.message


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("abc", [TextPrompt(text="abc")]),
        ([1, 2], [TokensPrompt(token_ids=[1, 2])]),
        (["a", "b"], [TextPrompt(text="a"), TextPrompt(text="b")]),
        ([[1], [2, 3]], [TokensPrompt(token_ids=[1]), TokensPrompt(token_ids=[2, 3])]),
        (["a"] * translate.MAX_PROMPTS, [TextPrompt(text="a")] * translate.MAX_PROMPTS),
        ([7] * (translate.MAX_PROMPTS + 1), [TokensPrompt(token_ids=[7] * (translate.MAX_PROMPTS + 1))]),
    ],
)
def test_completion_prompts(prompt, expected):
    assert translate.completion_prompts(prompt) == expected


def test_a_request_holds_at_most_max_prompts_prompts():
    with pytest.raises(OpenAIError) as info:
        translate.completion_prompts([[1]] * (translate.MAX_PROMPTS + 1))
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert f"at most {translate.MAX_PROMPTS}" in info.value.message


def test_completion_jobs_one_per_prompt_with_their_own_ids():
    body = msgspec.json.decode(
        json.dumps({"model": "m", "prompt": ["a", "b"], "logprobs": 2, "max_tokens": 3}),
        type=CompletionRequest,
    )
    jobs = translate.completion_jobs(body, translate.Route("base", "ad"), "c1")
    assert [j.request.request_id for j in jobs] == ["c1-0", "c1-1"]
    assert all(j.request.model == "base" and j.request.adapter == "ad" for j in jobs)
    assert jobs[0].request.output.logprobs == 2 and jobs[0].request.stop.max_tokens == 3


@pytest.mark.parametrize(
    ("path", "params", "param"),
    [
        ("$.sampling.temperature", {}, "temperature"),
        ("$.stop.max_tokens", {"$.stop.max_tokens": "max_completion_tokens"}, "max_completion_tokens"),
        ("$.stop.stop[1]", {}, "stop[1]"),
        ("$.output.logprobs", {"$.output.logprobs": "top_logprobs"}, "top_logprobs"),
        ("$.prompt.messages[2].content", {"$.prompt": "messages"}, "messages[2].content"),
        ("$.prompt", {"$.prompt": "messages"}, "messages"),
        ("$.prompt.text", {"$.prompt": "prompt", "$.prompt.text": "prompt"}, "prompt"),
        ("$.structured.json_schema", {"$.structured": "guided_json"}, "guided_json.json_schema"),
        ("$.adapter", {}, "model"),
        ("$.somewhere_new", {}, "somewhere_new"),
        (None, {}, None),
    ],
)
def test_field_paths_become_parameters(path, params, param):
    assert translate.param_of(path, params) == param


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        (
            '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
            None,
            [tools.ParsedCall("f", '{"x": 1}')],
        ),
        (
            'Let me look.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>',
            "Let me look.",
            [tools.ParsedCall("f", "{}"), tools.ParsedCall("g", '{"y": 2}')],
        ),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
)
def test_hermes_tool_calls(text, content, calls):
    assert tools.parse_hermes(text) == (content, calls)


def test_tool_choice_plans_and_their_constraints():
    fs = [
        msgspec.convert(
            {"function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {}}}}}, tools.Tool
        ),
        msgspec.convert({"function": {"name": "g"}}, tools.Tool),
    ]
    assert tools.plan(None, None).mode == "none"
    assert tools.plan(fs, None).mode == "auto"
    assert tools.plan(fs, "none").mode == "none"
    named = tools.plan(fs, msgspec.convert({"function": {"name": "f"}}, tools.NamedToolChoice))
    assert named.named == "f" and named.constraint.json_schema["properties"] == {"a": {}}
    required = tools.plan(fs, "required")
    assert required.constraint.json_schema["minItems"] == 1
    assert tools.calls(named, '{"a": 1}') == (None, [tools.ParsedCall("f", '{"a": 1}')])
    assert tools.calls(required, '[{"name": "g", "parameters": {}}]') == (None, [tools.ParsedCall("g", "{}")])
    assert tools.calls(required, "oops") == ("oops", [])


def test_every_error_code_has_a_status_and_capacity_errors_say_when_to_retry():
    for code in ErrorCode:
        assert code in STATUS, code
    assert from_code(ErrorCode.TIMEOUT, "x", retry_after=4).headers() == {"Retry-After": "4"}
    assert from_code(ErrorCode.INVALID_REQUEST, "x").headers() == {}
    assert from_code(ErrorCode("from_the_future"), "x").status == 500


def _instance(name: str, model: str, *, adapters=(), state="serving", ready=True) -> InstanceRecord:
    return InstanceRecord(
        instance=name,
        role="generate",
        model=model,
        state=state,
        ready=ready,
        adapters=list(adapters),
        heartbeat_at=time.time(),
        expires_after=10,
    )


@pytest.mark.parametrize(
    ("name", "live", "known", "outcome"),
    [
        ("m", [_instance("a", "m")], [], translate.Route("m")),
        ("ad", [_instance("a", "m", adapters=["ad"])], [], translate.Route("m", "ad")),
        ("m", [_instance("a", "m", adapters=["m"])], [], translate.Route("m")),
        ("m", [_instance("a", "m", state="sleeping", ready=False)], [], 503),
        ("m", [_instance("a", "m", state="draining")], [], 503),
        ("m", [], ["m"], 503),
        ("x", [_instance("a", "m")], ["m"], 404),
    ],
)
def test_which_model_a_name_routes_to(name, live, known, outcome):
    if isinstance(outcome, int):
        with pytest.raises(OpenAIError) as info:
            capacity.resolve(name, live, known, retry_after=2)
        assert info.value.status == outcome
        assert ("Retry-After" in info.value.headers()) == (outcome == 503)
    else:
        assert capacity.resolve(name, live, known, retry_after=2) == outcome


@pytest.mark.parametrize(
    ("depth", "limit", "jobs", "refused"),
    [
        (0, None, 1, None),
        (99, None, 500, None),
        (3, 3, 1, None),
        (4, 3, 1, 429),
        (1, 0, 1, 429),
        (1, 3, 3, None),  # its other two jobs count as waiting: 1 + 2 is not more than 3
        (2, 3, 3, 429),
        (0, 3, 4, None),
        (0, 3, 50, None),  # an empty queue takes any request: one this big could never run else
        (0, 0, 2, None),
        (1, 3, 5, 429),
    ],
)
def test_a_deep_queue_is_a_429(depth, limit, jobs, refused):
    if refused:
        with pytest.raises(OpenAIError) as info:
            capacity.admit("m", depth, limit, retry_after=1, jobs=jobs)
        assert info.value.status == refused
        assert info.value.headers() == {"Retry-After": "1"} and info.value.code == "queue_full"
    else:
        capacity.admit("m", depth, limit, retry_after=1, jobs=jobs)


def test_models_list_adapters_under_their_base():
    found = capacity.models(
        [_instance("a", "m", adapters=["ad"]), _instance("b", "m"), _instance("c", "z", state="sleeping")]
    )
    assert [(m["id"], m["parent"]) for m in found] == [("m", None), ("ad", "m")]


def _tokens(index: int, text: str, seq: int) -> TokensFrame:
    return TokensFrame(
        seq=seq, token_ids=[seq], index=index, text=text, logprobs=[-0.5], top_logprobs=[{seq: -0.5, 9: -1.0}]
    )


def _final(*reasons: str) -> FinalFrame:
    return FinalFrame(
        seq=99,
        request_id="r",
        choices=[Choice(index=i, finish_reason=r, completion_tokens=1) for i, r in enumerate(reasons)],
        usage=Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
    )


def test_a_whole_chat_answer_with_logprobs_and_usage():
    c = Collected(1, logprobs=True)
    c.tokens(_tokens(0, "he", 1))
    c.tokens(_tokens(0, "llo", 2))
    c.final(_final("length"))
    out = c.chat("id", 1, "m", tools.ToolPlan("none"))
    (choice,) = out["choices"]
    assert (
        choice["message"] == {"role": "assistant", "content": "hello"} and choice["finish_reason"] == "length"
    )
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["token_id:1", "token_id:2"]
    assert choice["logprobs"]["content"][0]["top_logprobs"][1] == {
        "token": "token_id:9",
        "logprob": -1.0,
        "bytes": None,
    }
    assert out["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    cmpl = c.completion("id", 1, "m")["choices"][0]
    assert cmpl["text"] == "hello" and cmpl["logprobs"]["text_offset"] == [0, 2]


def test_streamed_hermes_calls_hold_back_a_tag_and_send_the_calls_at_the_end():
    s = ChatStream("id", 1, "m", 1, tools.ToolPlan("auto"), include_usage=False)
    pieces = ["Sure", " <tool", '_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    chunks = [
        c for i, p in enumerate(pieces) for c in s.tokens(TokensFrame(seq=i + 1, token_ids=[1], text=p))
    ]
    chunks += s.final(_final("stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure "
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'} and calls[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_tool_streams_its_arguments():
    s = ChatStream("id", 1, "m", 1, tools.ToolPlan("named", named="f"), include_usage=True)
    chunks = [
        c
        for i, p in enumerate(['{"a"', ": 1}"])
        for c in s.tokens(TokensFrame(seq=i + 1, token_ids=[1], text=p))
    ]
    calls = [
        c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]
    ]
    assert calls[0]["function"]["name"] == "f"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"a": 1}'
    assert all(c["usage"] is None for c in chunks)


@pytest.mark.parametrize(
    ("plan", "text", "reason", "expected"),
    [
        (tools.ToolPlan("named", named="f"), '{"a": 1}', "stop", "stop"),
        (tools.ToolPlan("named", named="f"), '{"a": "cut sh', "length", "length"),
        (
            tools.ToolPlan("auto"),
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
            "stop",
            "tool_calls",
        ),
        (
            tools.ToolPlan("auto"),
            '<tool_call>{"name": "f", "arguments": {}}</tool_call> and',
            "length",
            "length",
        ),
        (tools.ToolPlan("auto"), "no call", "stop", "stop"),
        (tools.ToolPlan("required"), '[{"name": "f", "parameters": {}}]', "stop", "tool_calls"),
    ],
)
def test_a_tool_call_answer_keeps_the_engines_finish_reason(plan, text, reason, expected):
    """A named function or a cut-off output is not the model choosing to call: whole or streamed,
    only a model that stopped by itself after its calls says "tool_calls"."""
    frame = TokensFrame(seq=1, token_ids=[1], text=text)
    whole = Collected(1, logprobs=False)
    whole.tokens(frame)
    whole.final(_final(reason))
    stream = ChatStream("id", 1, "m", 1, plan, include_usage=False)
    chunks = stream.tokens(frame) + stream.final(_final(reason))
    assert whole.chat("id", 1, "m", plan)["choices"][0]["finish_reason"] == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [
        expected
    ]


def test_tool_messages_reach_the_template_with_arguments_as_a_mapping():
    job = chat(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    )
    prompt = job.request.prompt
    assert prompt.tools[0].function.name == "f"
    assistant, tool = (template_message(m) for m in prompt.messages[1:])
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_the_gateway_imports_neither_vllm_nor_torch():
    import subprocess
    import sys

    code = (
        "import sys; from jetllm.gateway import create_app, GatewayConfig; create_app(GatewayConfig()); "
        "print('vllm' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]


# batch lines: one body of an endpoint as its one job, and its stored Result read back


@pytest.mark.parametrize(
    ("endpoint", "body", "check"),
    [
        (CHAT, {"messages": USER}, lambda r: isinstance(r.prompt, ChatPrompt) and r.reply_to is None),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            lambda r: r.prompt.messages[0].content == "hi",
        ),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 5}, lambda r: r.stop.max_tokens == 5),
        (COMPLETIONS, {"prompt": ["hi"]}, lambda r: r.prompt == TextPrompt(text="hi")),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, lambda r: r.prompt == TokensPrompt(token_ids=[1, 2, 3])),
        (CHAT, {"messages": USER, "max_completion_tokens": 7}, lambda r: r.stop.max_tokens == 7),
        (
            COMPLETIONS,
            {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n"},
            lambda r: (
                (r.sampling.temperature, r.sampling.top_p, r.sampling.seed, r.stop.stop)
                == (0.5, 0.9, 3, ["\n"])
            ),
        ),
        (CHAT, {"messages": USER, "n": 2, "temperature": 1}, lambda r: r.sampling.n == 2),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 3}, lambda r: r.output.logprobs == 3),
        (COMPLETIONS, {"prompt": "x", "logprobs": 2}, lambda r: r.output.logprobs == 2),
        (
            CHAT,
            {"messages": USER, "response_format": {"type": "json_object"}},
            lambda r: r.structured == JsonObjectOutput(),
        ),
        (
            CHAT,
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
            lambda r: r.prompt.tools[0].function.name == "f",
        ),
        (
            CHAT,
            {"messages": USER, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.2, "guided_regex": "a+"},
            lambda r: r.sampling.top_k == 4 and r.structured == RegexOutput(pattern="a+"),
        ),
        (CHAT, {"messages": USER, "user": "u1", "metadata": {"a": "b"}}, lambda r: r.model == "m"),
    ],
)
def test_batch_line_bodies_become_jobs_as_the_gateways(endpoint, body, check):
    prepared = endpoints.prepare(endpoint, {"model": "m", **body}, "batch-1-1")
    assert prepared.job.request.request_id == "batch-1-1"
    assert check(prepared.job.request)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (CHAT, {"messages": USER}, "model"),
        (CHAT, {"model": "m"}, "messages"),
        (CHAT, {"model": "", "messages": USER}, "model"),
        (COMPLETIONS, {"model": "m", "prompt": ""}, "prompt"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "temperature": 9}, "temperature"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        (COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}, "prompt"),
        (CHAT, {"model": "m", "messages": USER, "stream": True}, "stream"),
        (CHAT, {"model": "m", "messages": USER, "tool_choice": "required"}, "tool_choice"),
        (CHAT, {"model": "m", "messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        (CHAT, [1, 2], None),
        ("/v1/embeddings", {"model": "m", "prompt": "x"}, "url"),
    ],
)
def test_batch_line_bodies_that_cannot_run_name_the_parameter(endpoint, body, param):
    with pytest.raises(OpenAIError) as info:
        endpoints.prepare(endpoint, body, "r-1")
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def _worker_result(frames: list[TokensFrame], final: FinalFrame, n: int, logprobs: bool) -> Result:
    """The Result a worker stores after sending `frames` (workers/requestlog.py keeps its parts)."""
    texts = ["" for _ in range(n)]
    kept = [ChoiceLogprobs(logprobs=[]) for _ in range(n)] if logprobs else None
    for f in frames:
        if kept is not None:
            keep_logprobs(kept[f.index], f.token_ids, f.logprobs, f.top_logprobs, len(texts[f.index]))
        texts[f.index] += f.text or ""
    token_ids = [[t for f in frames if f.index == i for t in f.token_ids] for i in range(n)]
    return Result(attempt=1, final=final, token_ids=token_ids, text=texts, logprobs=kept)


def _streamed(prepared: endpoints.Prepared, frames: list[TokensFrame], final: FinalFrame) -> dict:
    """The gateway's whole answer: its endpoint's Collected, fed the frames as they arrive."""
    req = prepared.job.request
    c = Collected(req.sampling.n, req.output.logprobs is not None)
    for f in frames:
        c.tokens(f)
    c.final(final)
    rid = endpoints.response_id(prepared.endpoint, req.request_id)
    if prepared.endpoint == CHAT:
        return c.chat(rid, 1, "m", prepared.job.tool_plan)
    return c.completion(rid, 1, "m", token_ids=prepared.body.return_token_ids)


def _frame(index: int, ids: list[int], text: str, seq: int, top: int | None = None) -> TokensFrame:
    lps = [-0.25 * t for t in ids] if top is not None else None
    tops = [{t: -0.25 * t, t + 1: -9.0} for t in ids][: len(ids)] if top else None
    return TokensFrame(seq=seq, index=index, token_ids=ids, text=text, logprobs=lps, top_logprobs=tops)


def _no_call_ids(body: dict) -> dict:
    for choice in body.get("choices", []):
        for call in choice.get("message", {}).get("tool_calls") or []:
            call["id"] = "call"
    return body


NAMED_TOOL = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
}


@pytest.mark.parametrize(
    ("endpoint", "body", "frames", "reasons"),
    [
        (
            CHAT,
            {"messages": USER, "n": 2},
            [_frame(0, [5], "a", 1), _frame(1, [6, 7], "bc", 2)],
            ["stop"] * 2,
        ),
        (
            CHAT,
            {"messages": USER, "logprobs": True, "top_logprobs": 2},
            [_frame(0, [5, 6], "ab", 1, top=2), _frame(0, [7], "", 2, top=2), _frame(0, [8], "c", 3, top=2)],
            ["length"],
        ),
        (
            COMPLETIONS,
            {"prompt": "x", "n": 2, "logprobs": 1},
            [
                _frame(0, [5, 6], "ab", 1, top=1),
                _frame(1, [9], "z", 2, top=1),
                _frame(0, [7], "cd", 3, top=1),
                _frame(0, [8], "", 4, top=1),
            ],
            ["length", "stop"],
        ),
        (COMPLETIONS, {"prompt": [1, 2], "return_token_ids": True}, [_frame(0, [3, 4], "q", 1)], ["stop"]),
        (
            CHAT,
            {"messages": USER, "response_format": {"type": "json_object"}},
            [_frame(0, [5], '{"a": 1}', 1)],
            ["stop"],
        ),
        (CHAT, {"messages": USER, **NAMED_TOOL}, [_frame(0, [5], '{"x": 2}', 1)], ["stop"]),
        (
            CHAT,
            {"messages": USER, "tools": NAMED_TOOL["tools"]},
            [_frame(0, [5], 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>', 1)],
            ["stop"],
        ),
    ],
)
def test_a_stored_result_answers_what_the_gateway_streamed(endpoint, body, frames, reasons):
    prepared = endpoints.prepare(endpoint, {"model": "m", **body}, "batch-1-1")
    final = _final(*reasons)
    result = _worker_result(frames, final, len(reasons), prepared.job.request.output.logprobs is not None)
    status, answer = stored.response(prepared, result, 1)
    assert status == 200
    assert _no_call_ids(answer) == _no_call_ids(_streamed(prepared, frames, final))
    assert answer["id"] == ("chatcmpl-" if endpoint == CHAT else "cmpl-") + "batch-1-1"


@pytest.mark.parametrize(
    ("error", "status", "param"),
    [
        (
            ErrorFrame(seq=9, request_id="r", code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, message="long"),
            400,
            None,
        ),
        (
            ErrorFrame(
                seq=9, request_id="r", code=ErrorCode.INVALID_REQUEST, message="x", field="$.stop.max_tokens"
            ),
            400,
            "max_completion_tokens",
        ),
        (ErrorFrame(seq=9, request_id="r", code=ErrorCode.MODEL_NOT_SERVED, message="x"), 404, None),
        (ErrorFrame(seq=9, request_id="r", code=ErrorCode.TIMEOUT, message="x"), 503, None),
        (
            ErrorFrame(
                seq=9,
                request_id="r",
                code=ErrorCode.PAYLOAD_TOO_LARGE,
                message="x",
                field="$.output.logprobs",
            ),
            413,
            "top_logprobs",
        ),
        (None, 500, None),
    ],
)
def test_a_failed_line_answers_the_gateways_error(error, status, param):
    prepared = endpoints.prepare(CHAT, {"model": "m", "messages": USER, "max_completion_tokens": 3}, "r")
    got_status, body = stored.response(prepared, Result(attempt=1, error=error), 1)
    assert (got_status, body["error"]["param"]) == (status, param)
    if error is not None:
        assert body == from_code(error.code, error.message, param=param).body()


def test_the_translation_and_the_batch_runner_need_no_http_stack():
    """`jetllm batch` and `jetllm batch-runner` run without the `gateway` extra."""
    import subprocess
    import sys

    modules = "jetllm.openai.endpoints, jetllm.openai.stored, jetllm.openai.streams, jetllm.batches.runner"
    code = f"import sys, {modules}; print(sorted(m for m in ('starlette', 'uvicorn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr
