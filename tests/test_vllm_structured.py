"""Structured outputs through jetllm on a real vLLM worker: each kind constrains, bad constraints are
typed errors naming the field, and a structured request moved by a drain keeps its constraint."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import uuid

import anyio
import jsonschema
import lark
import msgspec
import pytest

from jetllm.errors import RequestFailed, RequestRejected
from jetllm.producer import Client
from jetllm.schemas import (
    ChoiceOutput,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    OutputOptions,
    RegexOutput,
    SamplingOptions,
    StopConditions,
    TokensFrame,
    TokensPrompt,
)

from .conftest import TINY
from .test_vllm_chaos import Tracker, follow

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

PROMPT = [1, 5, 6, 7, 8]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "pattern": "^[a-z]{120}$"},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["word", "color"],
    "additionalProperties": False,
}
LARK = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/'
GBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
# Seeds with which the tiny random model closes the document well within max_tokens (found by
# search; JSON lets it choose whitespace between tokens, which it otherwise does for long).
SCHEMA_SEED = 3
OBJECT_SEED = 1
LONG_SEED = 0
UNSEEDED_ID = "structured-unseeded-1"


def request(structured, *, max_tokens: int = 200, prompt=PROMPT, **sampling) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"s-{uuid.uuid4().hex}",
        model=TINY,
        prompt=TokensPrompt(prompt),
        sampling=SamplingOptions(**{"temperature": 0.0, **sampling}),
        stop=StopConditions(max_tokens=max_tokens),
        output=OutputOptions(text=True),
        structured=structured,
    )


def test_the_worker_gives_vllm_the_constraint_its_seed_and_one_backend(tiny_model):
    """No engine: vLLM's own parameter and argument types."""
    from vllm.sampling_params import StructuredOutputsParams

    from jetllm.workers.engine import EngineOptions
    from jetllm.workers.engine.args import engine_args
    from jetllm.workers.engine.sampling import build_sampling_params

    kinds = [
        (JsonSchemaOutput(json_schema=SCHEMA), {"json": SCHEMA}),
        (JsonObjectOutput(), {"json_object": True}),
        (RegexOutput(pattern="a|b"), {"regex": "a|b"}),
        (ChoiceOutput(choices=["a", "b"]), {"choice": ["a", "b"]}),
        (GrammarOutput(grammar=GBNF), {"grammar": GBNF}),
    ]
    for constraint, kwargs in kinds:
        params = build_sampling_params(request(constraint, temperature=1.0), 8, {})
        assert params.structured_outputs == StructuredOutputsParams(**kwargs)
        assert params.seed is not None  # derived from the request id
    with pytest.raises(RequestRejected) as err:  # bounded before vLLM sees it
        too_wide = {"type": "object", "properties": {f"p{i}": {} for i in range(300)}}
        build_sampling_params(request(JsonSchemaOutput(json_schema=too_wide)), 8, {})
    assert err.value.field == "$.structured.json_schema"
    assert engine_args(EngineOptions(model=str(tiny_model))).structured_outputs_config.backend == "guidance"
    chosen = {"structured_outputs_config": {"backend": "xgrammar"}}
    assert engine_args(
        EngineOptions(model=str(tiny_model), extra=chosen)
    ).structured_outputs_config.backend == ("xgrammar")


@pytest.fixture
async def c(shared_vllm, nats_url):
    async with Client(nats_url, namespace=shared_vllm.namespace, heartbeat_timeout=30) as client:
        yield client


async def test_each_kind_of_constraint_shapes_the_output(c):
    reqs = {
        "schema": request(JsonSchemaOutput(json_schema=SCHEMA), temperature=1.0, seed=SCHEMA_SEED),
        "object": request(JsonObjectOutput(), temperature=1.0, seed=OBJECT_SEED),
        "regex": request(RegexOutput(pattern="[a-z]{3,8}-[0-9]{2}")),
        "choice": request(ChoiceOutput(choices=["alpha", "beta", "gamma"])),
        "lark": request(GrammarOutput(grammar=LARK)),
        "gbnf": request(GrammarOutput(grammar=GBNF)),
        "n=3": request(ChoiceOutput(choices=["alpha", "beta", "gamma"]), temperature=1.0, n=3, seed=1),
        "n=2 schema": request(JsonSchemaOutput(json_schema=SCHEMA), temperature=1.0, n=2, seed=SCHEMA_SEED),
    }
    got = {}

    async def run(name: str) -> None:
        got[name] = await c.complete(reqs[name])

    async with anyio.create_task_group() as tg:
        for name in reqs:
            tg.start_soon(run, name)
    assert all(r.finish_reason == "stop" for r in got.values()), {k: v.finish_reason for k, v in got.items()}
    jsonschema.validate(json.loads(got["schema"].text), SCHEMA)
    assert isinstance(json.loads(got["object"].text), dict)
    assert re.fullmatch("[a-z]{3,8}-[0-9]{2}", got["regex"].text)
    assert got["choice"].text in ("alpha", "beta", "gamma")
    lark.Lark(LARK).parse(got["lark"].text)
    assert re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9]))*\)", got["gbnf"].text)
    assert len(got["n=3"].choices) == 3 and all(
        ch.text in ("alpha", "beta", "gamma") for ch in got["n=3"].choices
    )
    for ch in got["n=2 schema"].choices:
        jsonschema.validate(json.loads(ch.text), SCHEMA)
    assert len({ch.text for ch in got["n=2 schema"].choices}) == 2  # each choice samples on its own


@pytest.mark.parametrize(
    ("structured", "field", "says"),
    [
        (JsonSchemaOutput(json_schema={"type": "nope"}), "$.structured.json_schema", "nope"),
        (RegexOutput(pattern="a(b"), "$.structured.pattern", "unclosed group"),
        (GrammarOutput(grammar="root ::= foo"), "$.structured.grammar", "foo"),
        # vLLM checks these without the tokenizer; the engine would answer with an empty output
        (GrammarOutput(grammar="start: <|nonexistent|>"), "$.structured.grammar", "unknown special token"),
        (GrammarOutput(grammar='start: "a" <[600]>'), "$.structured.grammar", "Token range end too large"),
        (
            JsonSchemaOutput(json_schema={"type": "object", "properties": {f"p{i}": {} for i in range(300)}}),
            "$.structured.json_schema",
            "300 properties in one object",
        ),
    ],
)
async def test_a_constraint_that_does_not_compile_is_invalid_request_naming_the_field(
    c, structured, field, says
):
    with pytest.raises(RequestFailed) as err:
        await c.complete(request(structured))
    assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.field == field
    assert says in str(err.value)
    ok = await c.complete(request(ChoiceOutput(choices=["x", "y"])))  # the worker goes on
    assert ok.text in ("x", "y")


def jetllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jetllm", *args], capture_output=True, text=True, timeout=300
    )


def test_the_cli_passes_constraints(shared_vllm, nats_url, tmp_path):
    where = ["--nats", nats_url, "--namespace", shared_vllm.namespace]
    r = jetllm(
        "generate",
        *where,
        "--tokens",
        "1,5,6,7,8",
        "--text-out",
        "--temperature",
        "0",
        "--choice",
        "alpha",
        "--choice",
        "beta",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("alpha", "beta")
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"token_ids": [1, 5, 6], "temperature": 0, "output": {"text": true}}\n'
        '{"token_ids": [1, 5, 7], "temperature": 0, "output": {"text": true}, '
        '"structured": {"type": "choice", "choices": ["yes", "no"]}}\n'
    )
    out = tmp_path / "out.jsonl"
    r = jetllm("batch", *where, "--model", TINY, str(src), "-o", str(out), "--regex", "[0-9]{4}")
    assert r.returncode == 0, r.stderr
    first, second = (json.loads(x) for x in out.read_text().splitlines())
    assert re.fullmatch("[0-9]{4}", first["text"]) and second["text"] in ("yes", "no")


async def test_structured_requests_moved_by_a_drain_keep_their_constraint_and_their_output(
    nats_url, shared_vllm, start_worker
):
    """A worker of its own joins the shared one's namespace and is drained; the shared worker,
    frozen until then, takes the requests over. The drained worker's engine runs 10 ms at a time
    until each request has its first tokens and stays frozen through the drain, so the requests
    are mid-stream when it comes however fast this machine generates (CI's loaded box once saw
    them finish before the drain)."""
    namespace, second = shared_vllm.namespace, shared_vllm
    first = start_worker(namespace, "--grace-period", "0.3")
    await first.wait_ready(nats_url, timeout=600)
    greedy = request(RegexOutput(pattern="[a-z]{400}"), max_tokens=480)  # short of the context
    seeded = request(
        JsonSchemaOutput(json_schema=LONG_SCHEMA), max_tokens=480, temperature=1.0, seed=LONG_SEED
    )
    unseeded = msgspec.structs.replace(
        request(JsonSchemaOutput(json_schema=LONG_SCHEMA), max_tokens=480, temperature=1.0),
        request_id=UNSEEDED_ID,  # its seed derives from it (one use per session's server)
    )
    async with Client(nats_url, namespace=namespace) as c:
        second.signal(signal.SIGSTOP)  # ready, but frozen until the first one drains
        try:
            await anyio.sleep(5)  # its outstanding pull requests expire on the server
            # Uninterrupted, and on the first worker: its engine has compiled both grammars before
            # the moved requests come, so they start together, none far ahead of the others.
            expected = [await c.complete(r) for r in (greedy, seeded)]
            moved = [msgspec.structs.replace(r, request_id=f"m-{uuid.uuid4().hex}") for r in (greedy, seeded)]
            moved.append(unseeded)
            trackers = {r.request_id: Tracker() for r in moved}
            async with anyio.create_task_group() as tg:
                with first.engine_frozen() as engine:
                    for r in moved:
                        tg.start_soon(follow, c, r, trackers[r.request_id])
                    await engine.step_until(lambda: min(len(t.tokens) for t in trackers.values()) >= 2)
                    ended = [
                        rid for rid, t in trackers.items() if any(isinstance(f, FinalFrame) for f in t.frames)
                    ]
                    assert not ended, f"ended before the drain: {ended}"
                    second.signal(signal.SIGCONT)
                    await first.drain_until_logged("handing back 3 running jobs")
        finally:
            second.signal(signal.SIGCONT)
    texts = []
    for r in moved:
        frames = trackers[r.request_id].frames
        assert not any(isinstance(f, ErrorFrame) for f in frames), frames[-1]
        assert isinstance(frames[-1], FinalFrame) and frames[-1].attempt >= 2  # finished on the second worker
        texts.append("".join(f.text or "" for f in frames if isinstance(f, TokensFrame)))
    assert trackers[moved[0].request_id].tokens == expected[0].token_ids  # greedy: as if never moved
    assert trackers[moved[1].request_id].tokens == expected[1].token_ids  # seeded: likewise
    assert re.fullmatch("[a-z]{400}", texts[0])
    for text in texts[1:]:
        jsonschema.validate(json.loads(text), LONG_SCHEMA)
