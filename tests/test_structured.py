"""Structured outputs without an engine: the wire form, the bounds, vLLM's parameters, the replay."""

from __future__ import annotations

import json

import msgspec
import pytest

from jetllm.errors import RequestRejected
from jetllm.schemas import (
    ChoiceOutput,
    ErrorCode,
    GenerateRequest,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    SamplingOptions,
    StopConditions,
    TokensFrame,
)
from jetllm.workers.engine import structured
from jetllm.workers.engine.sampling import field_of_error
from jetllm.workers.jobs import RejectedJob, decode_request
from jetllm.workers.requestlog import History
from jetllm.workers.roles.generate.continuation import Replay, how_to_continue
from jetllm.workers.roles.generate.stream import generate

from .fake_engine import FakeEngine
from .jobs import req

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


def job(constraint: dict) -> bytes:
    return json.dumps(
        {
            "v": 1,
            "request_id": "s-1",
            "model": "m",
            "prompt": {"type": "tokens", "token_ids": [1, 2]},
            "structured": constraint,
        }
    ).encode()


@pytest.mark.parametrize(
    ("constraint", "decoded"),
    [
        ({"type": "json_schema", "json_schema": SCHEMA}, JsonSchemaOutput(json_schema=SCHEMA)),
        ({"type": "json_object"}, JsonObjectOutput()),
        ({"type": "regex", "pattern": "[a-z]+"}, RegexOutput(pattern="[a-z]+")),
        ({"type": "choice", "choices": ["yes", "no"]}, ChoiceOutput(choices=["yes", "no"])),
        ({"type": "grammar", "grammar": 'root ::= "a"'}, GrammarOutput(grammar='root ::= "a"')),
    ],
)
def test_each_constraint_kind_decodes(constraint, decoded):
    got, _ = decode_request(job(constraint), {"Content-Type": "application/json"})
    assert got.structured == decoded


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"type": "regex", "pattern": "a", "choices": ["b"]}, "$.structured.choices"),  # two kinds at once
        ({"type": "json_object", "json_schema": SCHEMA}, "$.structured.json_schema"),
        ({"type": "choice", "choices": ["a"], "strict": True}, "$.structured.strict"),  # unknown field
        ({"type": "xml", "schema": "x"}, "$.structured.type"),  # unknown kind
        ({"type": "regex", "pattern": ""}, "$.structured.pattern"),
        ({"type": "choice", "choices": []}, "$.structured.choices"),
        ({"type": "choice", "choices": ["a", ""]}, "$.structured.choices[1]"),
        ({"type": "grammar"}, "$.structured.grammar"),
        ({"type": "json_schema", "json_schema": "not an object"}, "$.structured.json_schema"),
    ],
)
def test_constraints_are_strict_and_errors_name_the_field(constraint, field):
    with pytest.raises(RejectedJob) as err:
        decode_request(job(constraint), {"Content-Type": "application/json"})
    assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.field == field


def nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


def props(n: int, prefix: str = "p") -> dict:
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}


@pytest.mark.parametrize(
    ("constraint", "refused"),
    [
        (JsonSchemaOutput(json_schema=SCHEMA), None),
        (JsonSchemaOutput(json_schema=props(256)), None),
        (JsonSchemaOutput(json_schema=props(257)), "257 properties in one object"),
        (
            JsonSchemaOutput(
                json_schema={"type": "object", "properties": {f"o{j}": props(200) for j in range(6)}}
            ),
            "1206 in all",
        ),
        (JsonSchemaOutput(json_schema=nested(63)), None),  # 64 levels, as vLLM counts them
        (JsonSchemaOutput(json_schema=nested(64)), "more than 64 levels"),
        (JsonSchemaOutput(json_schema={"enum": ["v" * 100] * 700}), "bytes as JSON"),
        (ChoiceOutput(choices=["c" * 1000] * 66), "characters together"),
        (ChoiceOutput(choices=["c" * 1000] * 65), None),
        (RegexOutput(pattern="(a+)+b"), None),
        (JsonObjectOutput(), None),
    ],
)
def test_constraints_the_engine_could_not_compile_in_bounded_time_are_refused(constraint, refused):
    if refused is None:
        structured.check_bounds(constraint)
        return
    with pytest.raises(RequestRejected, match=refused) as err:
        structured.check_bounds(constraint)
    assert err.value.code == ErrorCode.INVALID_REQUEST
    assert err.value.field == structured.field_of(constraint)


@pytest.mark.parametrize(
    ("constraint", "parameter", "message", "field"),
    [
        (
            RegexOutput(pattern="a(b"),
            None,
            "Failed to transform regex into a grammar: ...",
            "$.structured.pattern",
        ),
        (GrammarOutput(grammar="root ::= x"), None, "Invalid grammar specification.", "$.structured.grammar"),
        (
            JsonSchemaOutput(json_schema={"type": "nope"}),
            None,
            "Failed to transform json schema into a grammar: Unsupported type",
            "$.structured.json_schema",
        ),
        (
            ChoiceOutput(choices=["a"]),
            None,
            "Failed to transform choices into a grammar",
            "$.structured.choices",
        ),
        (
            RegexOutput(pattern="a"),
            "temperature",
            "temperature must be non-negative",
            "$.sampling.temperature",
        ),
        (RegexOutput(pattern="a"), None, "top_p must be in (0, 1]", "$.sampling.top_p"),
        (RegexOutput(pattern="a"), None, "This model does not support generation", None),
        (None, None, "Invalid grammar specification.", None),  # no constraint: nothing to blame
    ],
)
def test_vllms_validation_errors_are_given_the_field(constraint, parameter, message, field):
    r = req("m", structured=constraint)
    assert field_of_error(r, parameter, message) == field


@pytest.mark.parametrize(
    ("constraint", "done", "how"),
    [
        (None, None, "prompt"),
        (None, "ended", "done"),
        (RegexOutput(pattern="a+"), None, "replay"),
        (JsonObjectOutput(), None, "replay"),
        (JsonObjectOutput(), "ended", "done"),
    ],
)
def test_how_a_request_continues_after_delivered_tokens(constraint, done, how):
    from jetllm.schemas import Choice

    ended = Choice(index=0, finish_reason="stop", completion_tokens=3) if done else None
    assert how_to_continue(req("m", structured=constraint), ended) == how


@pytest.mark.parametrize(
    ("delivered", "text", "deltas", "new", "error"),
    [
        # one token per step: the delivered ones are dropped, the rest pass
        ([5, 6], "ab", [([5], "a"), ([6], "b"), ([7], "c")], [([], ""), ([], ""), ([7], "c")], None),
        # a delta across the boundary is split, tokens and text alike
        ([5, 6], "ab", [([5, 6, 7], "abc"), ([8], "d")], [([7], "c"), ([8], "d")], None),
        # text held back by the detokenizer arrives with later tokens
        ([5, 6], "a", [([5], ""), ([6], "a"), ([7], "bc")], [([], ""), ([], ""), ([7], "bc")], None),
        # no text wanted
        ([5], None, [([5], None), ([9], None)], [([], None), ([9], None)], None),
        ([5, 6], "ab", [([5], "a"), ([4], "b")], None, "token 1 is 4, not the delivered 6"),
        ([5, 6], "ab", [([5, 6], "ax")], None, "departs from the delivered text"),
    ],
)
def test_a_replay_drops_what_was_delivered_and_refuses_anything_else(delivered, text, deltas, new, error):
    replay = Replay(delivered, text)
    got = []
    try:
        for tokens, piece in deltas:
            t, p, lp, _ = replay.take(tokens, piece, [0.0] * len(tokens), None)
            assert lp == [0.0] * len(t)
            got.append((t, p))
    except RequestRejected as exc:
        assert error is not None and error in str(exc), exc
        assert exc.code == ErrorCode.NOT_MIGRATABLE and exc.field == "$.structured"
        return
    assert error is None and got == new and replay.done


def test_a_replay_that_ends_early_is_refused():
    replay = Replay([5, 6, 7], None)
    replay.take([5], None)
    with pytest.raises(RequestRejected, match="ended after 1 of the 3 delivered tokens"):
        replay.finished()


def history_of(tokens: list[int], texts: list[str] | None = None) -> History:
    frames = [
        TokensFrame(seq=i + 1, index=0, token_ids=[t], text=texts[i] if texts else None)
        for i, t in enumerate(tokens)
    ]
    return History(frames=frames, last_seq=len(frames), deaths=1)


def structured_request(**kw) -> GenerateRequest:
    return req(
        "fake",
        structured=RegexOutput(pattern="[0-9]+"),
        stop=StopConditions(max_tokens=12, ignore_eos=True),
        **kw,
    )


@pytest.mark.anyio
async def test_a_moved_structured_request_replays_its_prompt_and_sends_only_what_is_new():
    engine = FakeEngine()
    r = structured_request()
    sent: list[list[int]] = []

    async def send(index, token_ids, text, logprobs, top):
        sent.append(token_ids)

    whole = await generate(engine, r, send, [5, 6, 7], History())
    sent.clear()
    moved = await generate(engine, r, send, [5, 6, 7], history_of(whole.token_ids[0][:5]))
    assert moved.token_ids == whole.token_ids and moved.choices == whole.choices
    assert [t for s in sent for t in s] == whole.token_ids[0][5:]
    assert moved.usage.prompt_tokens == 3  # the original prompt, not prompt + delivered


@pytest.mark.anyio
async def test_a_moved_structured_request_whose_replay_differs_ends_with_not_migratable():
    engine = FakeEngine()
    r = structured_request()
    sent: list[list[int]] = []

    async def send(index, token_ids, text, logprobs, top):
        sent.append(token_ids)

    whole = await generate(engine, r, send, [5, 6, 7], History())
    sent.clear()
    other = [*whole.token_ids[0][:3], (whole.token_ids[0][3] + 1) % 97]
    with pytest.raises(RequestRejected) as err:
        await generate(engine, r, send, [5, 6, 7], history_of(other))
    assert err.value.code == ErrorCode.NOT_MIGRATABLE and "token 3" in str(err.value)
    assert not any(sent)  # nothing after the delivered tokens reached the producer


def test_derived_seeds_are_stable_and_fit_a_64_bit_generator():
    assert structured.derived_seed("abc") == structured.derived_seed("abc") != structured.derived_seed("abd")
    assert 0 <= structured.derived_seed("abc") < 2**63
    assert msgspec.json.decode(msgspec.json.encode(structured.derived_seed("x"))) == structured.derived_seed(
        "x"
    )


def parse(*argv: str):
    import argparse

    from jetllm.cli import produce

    parser = argparse.ArgumentParser()
    produce.register(parser.add_subparsers())
    return parser.parse_args(list(argv))


def test_cli_flags_give_each_constraint(tmp_path):
    from jetllm.cli.produce import request_from_args

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"')
    cases = [
        (["--json-schema", str(schema)], JsonSchemaOutput(json_schema=SCHEMA)),
        (["--json-object"], JsonObjectOutput()),
        (["--regex", "[0-9]+"], RegexOutput(pattern="[0-9]+")),
        (["--choice", "yes", "--choice", "no"], ChoiceOutput(choices=["yes", "no"])),
        (["--grammar", str(grammar)], GrammarOutput(grammar='start: "a"')),
        ([], None),
    ]
    for flags, expected in cases:
        assert request_from_args(parse("generate", "hi", *flags)).structured == expected
        assert parse("batch", "in.jsonl", *flags).json_object == ("--json-object" in flags)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--regex", "a", "--json-object"], "not allowed with argument"),
        (["--json-schema", "missing.json"], "cannot read missing.json"),
        (["--json-schema", "{bad}"], "not JSON"),
        (["--json-schema", "[1]"], "must hold a JSON object"),
    ],
)
def test_cli_constraint_mistakes_stop_the_command_with_the_reason(flags, says, tmp_path, monkeypatch, capsys):
    from jetllm.cli.produce import request_from_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "{bad}").write_text("{bad")
    (tmp_path / "[1]").write_text("[1]")
    with pytest.raises(SystemExit) as exc:
        request_from_args(parse("generate", "hi", *flags))
    assert says in str(exc.value.code) + capsys.readouterr().err


def test_a_batch_lines_own_constraint_wins_over_the_command_lines():
    from jetllm.batch import to_request
    from jetllm.schemas import BatchLine

    line = msgspec.json.decode(
        b'{"prompt": "x", "structured": {"type": "regex", "pattern": "a+"}}', type=BatchLine
    )
    cli = ChoiceOutput(choices=["b"])
    assert to_request(line, "r", "m", None, cli).structured == RegexOutput(pattern="a+")
    plain = BatchLine(prompt="x")
    assert to_request(plain, "r", "m", None, cli).structured == cli
    assert to_request(plain, "r", "m", None).structured is None


@pytest.mark.parametrize(
    ("constraint", "kwargs"),
    [
        (JsonSchemaOutput(json_schema=SCHEMA), {"json": SCHEMA}),
        (JsonObjectOutput(), {"json_object": True}),
        (RegexOutput(pattern="a|b"), {"regex": "a|b"}),
        (ChoiceOutput(choices=["a", "b"]), {"choice": ["a", "b"]}),
        (GrammarOutput(grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ],
)
def test_each_kind_maps_to_vllms_structured_outputs_arguments(constraint, kwargs):
    assert structured.vllm_kwargs(constraint) == kwargs


@pytest.mark.parametrize(
    ("request_id", "seed", "constraint", "expected"),
    [
        ("r1", None, JsonObjectOutput(), structured.derived_seed("r1")),
        ("r2", None, JsonObjectOutput(), structured.derived_seed("r2")),
        ("r1", 5, JsonObjectOutput(), 5),  # the request's own seed wins
        ("r1", None, None, None),  # unstructured: unchanged
        ("r1", 7, None, 7),
    ],
)
def test_an_unseeded_structured_request_samples_with_a_seed_of_its_request_id(
    request_id, seed, constraint, expected
):
    r = req(
        "m",
        request_id=request_id,
        sampling=SamplingOptions(temperature=1.0, seed=seed),
        structured=constraint,
    )
    assert structured.sampling_seed(r) == expected
