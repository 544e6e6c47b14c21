"""The wire contract: names, encodings, versions, limits (no server needed)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jetllm.cli.reference import SECTIONS
from jetllm.cli.reference_cmd import json_schemas, wire_types
from jetllm.errors import ServerTooOld
from jetllm.schemas import ErrorCode, ErrorFrame, Frame, GenerateRequest, TokensFrame, TokensPrompt
from jetllm.subjects import codec
from jetllm.subjects.codec import field_path
from jetllm.subjects.names import Names, decode_token, encode_token, is_safe_reply_subject
from jetllm.subjects.server import check_version
from jetllm.workers.jobs import RejectedJob, decode_request

from .helpers.wire import wire_structs


@given(st.text(min_size=1, max_size=80))
def test_any_name_escapes_into_one_valid_token_and_back(name):
    token = encode_token(name)
    assert decode_token(token) == name
    assert all(c.isascii() and (c.isalnum() or c in "-_") for c in token)


def test_model_names_with_slashes_and_dots_become_tokens():
    names = Names("prod")
    assert names.jobs("generate", "Qwen/Qwen3-0.6B") == "jetllm.prod.jobs.generate.Qwen_2FQwen3-0_2E6B"
    assert names.parse_jobs(names.jobs("generate", "a.b/c")) == ("generate", "a.b/c")
    assert names.consumer("generate", "Qwen/Qwen3-0.6B") == "generate_Qwen_2FQwen3-0_2E6B"


def test_bad_namespace_is_refused():
    with pytest.raises(ValueError):
        Names("Has.Dots")


@pytest.mark.parametrize(
    "subject,ok",
    [
        ("_INBOX.abc.def", True),
        ("replies.client7", True),
        ("$JS.API.STREAM.DELETE.X", False),
        ("$SYS.REQ.SERVER.PING", False),
        ("jetllm.default.cancel.x", False),
        ("a.*.c", False),
        ("a.>", False),
        ("a..b", False),
        ("a b", False),
        ("", False),
        ("x" * 300, False),
    ],
)
def test_reply_subject_safety(subject, ok):
    assert is_safe_reply_subject(subject) is ok


@pytest.mark.parametrize("version", ["2.9.10", "2.2.0", "v1.4.1"])
def test_old_servers_are_refused_with_the_reason(version):
    with pytest.raises(ServerTooOld, match="silently drop"):
        check_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.15.1", "v2.11.3-beta.1", "3.0.0"])
def test_current_servers_are_accepted(version):
    check_version(version)


def test_requests_round_trip_in_both_encodings():
    req = GenerateRequest(request_id="r1", model="m", prompt=TokensPrompt([1, 2, 3]), reply_to="_INBOX.x")
    for enc in ("msgpack", "json"):
        data = codec.encode(req, enc)
        assert codec.request_decoder.decode(data, enc) == req
    assert json.loads(codec.encode(req, "json"))["v"] == 1


def test_frames_are_a_tagged_union():
    frames = [
        TokensFrame(seq=2, token_ids=[5]),
        ErrorFrame(seq=3, request_id="r", code=ErrorCode.MALFORMED, message="m"),
    ]
    for f in frames:
        assert msgspec.msgpack.decode(codec.encode(f), type=Frame) == f
    assert json.loads(codec.encode(frames[0], "json"))["kind"] == "tokens"


def test_content_type_decides_the_encoding():
    assert codec.encoding_of(None) == "msgpack"
    assert codec.encoding_of({"Content-Type": "application/json; charset=utf-8"}) == "json"
    with pytest.raises(codec.UnknownContentType):
        codec.encoding_of({"content-type": "text/yaml"})


def test_decode_errors_name_the_field():
    good = {"request_id": "r", "model": "m", "prompt": {"type": "text", "text": "hi"}}
    with pytest.raises(RejectedJob) as e:
        decode_request(
            msgspec.json.encode({**good, "sampling": {"top_p": 3}}), {"Content-Type": "application/json"}
        )
    assert e.value.field == "$.sampling.top_p" and e.value.request_id == "r"
    with pytest.raises(RejectedJob) as e:
        decode_request(
            msgspec.json.encode({**good, "v": 7, "new_field": 1}), {"Content-Type": "application/json"}
        )
    assert e.value.code == ErrorCode.UNSUPPORTED_VERSION
    assert field_path("Object missing required field `model`") == "$.model"


def test_every_wire_type_has_a_json_schema():
    schemas = json_schemas()
    assert set(schemas) == set(wire_types())
    assert "GenerateRequest" in json.dumps(schemas["GenerateRequest"])


def test_jetllm_schema_exports_every_struct_of_the_schemas_package():
    exported = {name for schema in json_schemas().values() for name in schema["$defs"]}
    missing = sorted(c.__name__ for c in wire_structs() if c.__name__ not in exported)
    assert not missing, (
        f"not reachable from `jetllm schema` (add to jetllm.cli.reference_cmd.wire_types): {missing}"
    )
    tabled = {t for _, types in SECTIONS for t in types}
    missing = sorted(c.__name__ for c in wire_structs() if c not in tabled)
    assert not missing, f"no table in docs/messages.md (add them to jetllm.cli.reference.SECTIONS): {missing}"


def test_exported_error_codes_are_open():
    codes = json_schemas()["Frame"]["$defs"]["ErrorCode"]
    assert codes["anyOf"] == [{"enum": sorted(c.value for c in ErrorCode)}, {"type": "string"}]
