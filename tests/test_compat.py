"""Rolling upgrades: today's readers against messages from a newer version.

What workers and services report (frames, replies, records, events) may carry fields, error codes
and frame kinds this version does not know, and still reads; what a worker is told (jobs, control
requests, adapter specs) still refuses a field it does not know, naming it.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import msgspec
import pytest

from jetllm import batch
from jetllm.errors import RequestFailed
from jetllm.producer import deadletters, fleet, kvevents, lora, registry, results, traces
from jetllm.schemas import (
    AcceptedFrame,
    AdapterList,
    AdapterManifest,
    AdapterReply,
    AdapterSpec,
    BatchError,
    BatchResult,
    CancelRequest,
    Choice,
    Claim,
    ControlDone,
    ControlFailed,
    DeadLetter,
    EngineInfo,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    HealthCheck,
    HealthReport,
    HeartbeatFrame,
    InstanceRecord,
    KvCleared,
    KvEventBatch,
    KvRemoved,
    KvResync,
    KvStored,
    LoadedAdapter,
    LoadReport,
    LoraLoad,
    LoraUnload,
    ModelCard,
    Result,
    SleepRequest,
    StatusRequest,
    Step,
    Strict,
    TokensFrame,
    Tolerant,
    TraceRecord,
    Usage,
    WorkerStatus,
)
from jetllm.subjects import codec
from jetllm.workers import control, requestlog
from jetllm.workers.jobs import RejectedJob, decode_request
from jetllm.workers.lora import desired as lora_desired
from jetllm.workers.lora import files as lora_files

from .helpers.wire import wire_structs
from .jobs import req

NEW = {"added_later": {"nested": [1, "two"], "flag": True}}
"""A field a newer writer might add, of a shape no reader here expects."""

STRICT = {
    "GenerateRequest",
    "TokensPrompt",
    "ChatPrompt",
    "ChatMessage",
    "TextPrompt",
    "EmbedsPrompt",
    "SamplingOptions",
    "StopConditions",
    "OutputOptions",
    "JsonSchemaOutput",
    "JsonObjectOutput",
    "RegexOutput",
    "ChoiceOutput",
    "GrammarOutput",
    "CancelRequest",
    "StatusRequest",
    "HealthCheck",
    "SleepRequest",
    "LoraLoad",
    "LoraUnload",
    "AdapterSpec",
    "AdapterManifest",
    "BatchLine",
    "PrefillRequest",
    "ShardJob",
    "BatchRun",
    "ToolSpec",
    "ToolFunction",
    "ToolCall",
    "ToolCallFunction",
}
"""What a producer, operator or tool tells a worker (or `jetllm batch`): everything else is a report."""


def test_what_a_worker_is_told_is_strict_and_everything_else_tolerant():
    structs = wire_structs()
    assert {c.__name__ for c in structs if issubclass(c, Strict)} == STRICT
    for cls in structs:
        assert issubclass(cls, Strict) != issubclass(cls, Tolerant), (
            f"{cls.__name__}: one rule, not both or none"
        )
        assert cls.__struct_config__.forbid_unknown_fields == (cls.__name__ in STRICT), cls


def with_new_fields(obj: Any) -> Any:
    """`obj` as a newer writer would send it: a new field in every struct, nested ones too."""
    if isinstance(obj, msgspec.Struct):
        out = msgspec.to_builtins(obj, builtin_types=(bytes,))
        for f in msgspec.structs.fields(obj):
            if f.encode_name in out:
                out[f.encode_name] = with_new_fields(getattr(obj, f.name))
        return {**out, **NEW}
    if isinstance(obj, list):
        return [with_new_fields(x) for x in obj]
    if isinstance(obj, dict):
        return {k: with_new_fields(v) for k, v in obj.items()}
    return msgspec.to_builtins(obj, builtin_types=(bytes,))


CHOICE = Choice(index=0, finish_reason="stop", stop_reason="\n", completion_tokens=3)
USAGE = Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=2)
LOADED = LoadedAdapter(name="a1", sha256="0" * 64, lora_id=7, source="object", version=2)

# (the decoder a reader uses today, a message as the current version writes it)
REPORTS: list[tuple[str, Any, msgspec.Struct]] = [
    (
        "frame",
        codec.frame_decoder,
        AcceptedFrame(seq=0, request_id="r", worker="w", model="m", job_ack="$JS.ACK.x"),
    ),
    (
        "frame",
        codec.frame_decoder,
        TokensFrame(
            seq=1, token_ids=[5, 6], text="ab", logprobs=[-0.1, -0.2], top_logprobs=[{5: -0.1}, {6: -0.2}]
        ),
    ),
    ("frame", codec.frame_decoder, HeartbeatFrame(seq=1, attempt=2)),
    ("frame", codec.frame_decoder, FinalFrame(seq=2, request_id="r", choices=[CHOICE], usage=USAGE)),
    (
        "frame",
        codec.frame_decoder,
        ErrorFrame(
            seq=2, request_id="r", code=ErrorCode.ENGINE_ERROR, message="x", field="$.prompt", retryable=True
        ),
    ),
    (
        "request log (client)",
        results._record_decoder,
        Step(attempt=1, frame=TokensFrame(seq=1, token_ids=[5], text="a")),
    ),
    (
        "request log (client)",
        results._record_decoder,
        Result(
            attempt=2,
            final=FinalFrame(seq=3, request_id="r", choices=[CHOICE], usage=USAGE),
            token_ids=[[5, 6, 7]],
            text=["abc"],
            worker="w",
            migrations=1,
        ),
    ),
    ("request log (worker)", requestlog._decoder, Claim(attempt=1, worker="w", at=1.5)),
    (
        "request log (worker)",
        requestlog._decoder,
        Result(attempt=1, error=ErrorFrame(seq=1, request_id="r", code=ErrorCode.CANCELLED, message="x")),
    ),
    (
        "status",
        fleet._decoder,
        WorkerStatus(
            instance="i",
            role="generate",
            model="m",
            state="serving",
            slots=4,
            in_flight=1,
            request_ids=["r"],
            extra={"engine": "fake"},
        ),
    ),
    (
        "control reply",
        fleet._reply_decoder,
        ControlDone(instance="i", verb="sleep", detail="slept", state="sleeping"),
    ),
    (
        "control reply",
        fleet._reply_decoder,
        ControlFailed(instance="i", code=ErrorCode.CONFLICT, message="busy"),
    ),
    (
        "control reply",
        fleet._reply_decoder,
        HealthReport(
            instance="i", healthy=True, engine_alive=True, state="serving", canary_ok=True, canary_tokens=4
        ),
    ),
    (
        "lora reply",
        lora._change_reply,
        AdapterReply(instance="i", name="a1", action="loaded", adapter=LOADED),
    ),
    (
        "lora reply",
        lora._change_reply,
        ControlFailed(instance="i", code=ErrorCode.NO_ADAPTER_SLOT, message="full"),
    ),
    (
        "lora reply",
        lora._list_reply,
        AdapterList(instance="i", adapters=[LOADED], capacity=2, failed={"b": "x"}),
    ),
    (
        "registry",
        registry._instance,
        InstanceRecord(
            instance="i",
            role="generate",
            model="m",
            state="serving",
            adapters=["a1"],
            engine=EngineInfo(engine="fake", block_size=16),
        ),
    ),
    ("registry", registry._card, ModelCard(model="m", source="tiny", max_model_len=128, eos_token_ids=[2])),
    (
        "load",
        codec.Decoder(LoadReport),
        LoadReport(instance="i", model="m", at=1.0, running=1, waiting=0, in_flight=1, slots=4, kv_usage=0.5),
    ),
    (
        "kv events",
        kvevents._decoder,
        KvEventBatch(
            instance="i",
            model="m",
            seq=3,
            events=[
                KvCleared(),
                KvStored(block_hashes=[1, 2], token_ids=list(range(32)), block_size=16, medium="GPU"),
                KvRemoved(block_hashes=[1]),
            ],
            resync=KvResync(reason="start", part=1, parts=1, blocks=2),
        ),
    ),
    (
        "traces",
        traces._decoder,
        TraceRecord(
            trace_id="a" * 32,
            span_id="b" * 16,
            request_id="r",
            instance="i",
            attempt=1,
            model="m",
            queued_at=1.0,
            pulled_at=2.0,
            ended_at=3.0,
            outcome="completed",
            frames=3,
        ),
    ),
    (
        "dead letters",
        deadletters._decoder,
        DeadLetter(
            code=ErrorCode.MALFORMED,
            reason="x",
            subject="s",
            deliveries=1,
            worker="w",
            failed_at=1.0,
            headers={"Content-Type": "application/msgpack"},
            payload=b"\x81\xa1v\x01",
        ),
    ),
    (
        "batch results",
        msgspec.json.Decoder(BatchResult),
        BatchResult(
            line=1,
            id="x",
            request_id="r",
            error=BatchError(code=ErrorCode.INVALID_REQUEST, message="m", field="$.a"),
        ),
    ),
]


def _decode(decoder: Any, data: bytes, encoding: codec.Encoding) -> Any:
    if isinstance(decoder, msgspec.json.Decoder):
        return decoder.decode(data)
    return decoder.decode(data, encoding)


@pytest.mark.parametrize(
    ("decoder", "message", "encoding"),
    [
        pytest.param(decoder, message, encoding, id=f"{reader}:{type(message).__name__}:{encoding}")
        for reader, decoder, message in REPORTS
        for encoding in ("msgpack", "json")
        if encoding == "json" or not isinstance(decoder, msgspec.json.Decoder)  # batch files are JSON lines
    ],
)
def test_reports_with_new_fields_read_as_today(decoder, message, encoding):
    newer = codec.encode(with_new_fields(message), encoding)
    assert b"added_later" in newer
    assert _decode(decoder, newer, encoding) == message


NEW_CODE = "gpu_on_fire"


def _with_code(message: msgspec.Struct, code: str) -> dict:
    out = msgspec.to_builtins(message, builtin_types=(bytes,))
    if "error" in out:
        out["error"]["code"] = code
    else:
        out["code"] = code
    return out


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
@pytest.mark.parametrize(
    ("decoder", "message"),
    [
        (codec.frame_decoder, ErrorFrame(seq=1, request_id="r", code=ErrorCode.INTERNAL, message="m")),
        (fleet._reply_decoder, ControlFailed(instance="i", code=ErrorCode.INTERNAL, message="m")),
        (lora._change_reply, ControlFailed(instance="i", code=ErrorCode.INTERNAL, message="m")),
        (
            deadletters._decoder,
            DeadLetter(
                code=ErrorCode.INTERNAL, reason="m", subject="s", deliveries=1, worker="w", failed_at=0.0
            ),
        ),
        (
            results._record_decoder,
            Result(attempt=1, error=ErrorFrame(seq=1, request_id="r", code=ErrorCode.INTERNAL, message="m")),
        ),
        (
            requestlog._decoder,
            Result(attempt=1, error=ErrorFrame(seq=1, request_id="r", code=ErrorCode.INTERNAL, message="m")),
        ),
    ],
    ids=["frame", "control", "lora", "dlq", "result", "worker-log"],
)
def test_an_unknown_error_code_keeps_its_string(decoder, message, encoding):
    got = decoder.decode(codec.encode(_with_code(message, NEW_CODE), encoding), encoding)
    code = (got.error if isinstance(got, Result) else got).code
    assert isinstance(code, ErrorCode) and not code.known
    assert code == NEW_CODE and code.value == NEW_CODE and f"{code}" == NEW_CODE
    assert all(code != known for known in ErrorCode)
    assert NEW_CODE.encode() in codec.encode(got, encoding)  # written back as it came (a relay, `dlq show`)


def test_known_codes_stay_the_members():
    assert ErrorCode("cancelled") is ErrorCode.CANCELLED and ErrorCode.CANCELLED.known
    assert (
        codec.frame_decoder.decode(
            codec.encode(ErrorFrame(seq=1, request_id="r", code=ErrorCode.CANCELLED, message="m"))
        ).code
        is ErrorCode.CANCELLED
    )
    with pytest.raises(msgspec.ValidationError, match=r"\$.code"):  # still a string, though
        codec.frame_decoder.decode(
            codec.encode({"kind": "error", "seq": 1, "request_id": "r", "code": 3, "message": "m"})
        )


def test_a_frame_of_an_unknown_kind_is_told_apart_from_a_broken_one():
    newer = codec.encode({"kind": "progress", "seq": 1, "queue_position": 3})
    with pytest.raises(codec.UnknownKind, match="progress") as e:
        codec.frame_decoder.decode(newer)
    assert e.value.kind == "progress" and isinstance(e.value, msgspec.ValidationError)
    broken = codec.encode({"kind": "tokens", "seq": "one", "token_ids": [1]})
    with pytest.raises(msgspec.ValidationError, match=r"\$.seq") as e2:
        codec.frame_decoder.decode(broken)
    assert not isinstance(e2.value, codec.UnknownKind)
    with pytest.raises(codec.UnknownKind):
        results._record_decoder.decode(codec.encode({"kind": "paused", "attempt": 1}))


# What a worker is told stays strict: (today's worker-side decoder, a valid message).
COMMANDS: list[tuple[Any, msgspec.Struct]] = [
    (codec.Decoder(CancelRequest), CancelRequest(request_id="r", reason="x")),
    (codec.Decoder(StatusRequest), StatusRequest()),
    (control.decoder(HealthCheck), HealthCheck(canary=False)),
    (control.decoder(SleepRequest), SleepRequest(level=2)),
    (control.decoder(LoraLoad), LoraLoad(name="a1", version=2)),
    (control.decoder(LoraUnload), LoraUnload(name="a1")),
    (lora_desired._spec, AdapterSpec(name="a1", source="path", ref="/adapters/a1")),
    (lora_files._manifest, AdapterManifest(name="a1", sha256="0" * 64, files={"x": "1" * 64}, size=3)),
]


@pytest.mark.parametrize(("decoder", "message"), COMMANDS, ids=[type(c[1]).__name__ for c in COMMANDS])
def test_what_a_worker_is_told_refuses_a_field_it_does_not_know(decoder, message):
    data = codec.encode(message)
    assert decoder.decode(data) == message
    with pytest.raises(msgspec.ValidationError, match="unknown field `added_later`"):
        decoder.decode(codec.encode({**msgspec.to_builtins(message), **NEW}))


def test_a_job_with_an_unknown_field_is_refused_naming_it():
    job = {"request_id": "r", "model": "m", "prompt": {"type": "text", "text": "hi"}}
    json_headers = {"Content-Type": "application/json"}
    for bad, where in [
        ({**job, "max_token": 5}, "$.max_token"),
        ({**job, "sampling": {"temprature": 0}}, "$.sampling.temprature"),
        ({**job, "prompt": {"type": "text", "text": "hi", "lang": "en"}}, "$.prompt.lang"),
    ]:
        with pytest.raises(RejectedJob) as e:
            decode_request(msgspec.json.encode(bad), json_headers)
        assert e.value.code == ErrorCode.INVALID_REQUEST and e.value.field == where
        assert "unknown field" in str(e.value)
    with pytest.raises(msgspec.ValidationError, match="unknown field `max_token`"):
        batch._line_decoder.decode(b'{"prompt": "hi", "max_token": 5}')


# End to end: a newer worker, played by hand, answers a job from today's Client.


async def _serve_one_job(client, frames: list[dict], records: list[dict] = ()) -> None:
    """Take one job off the queue and answer it as a newer worker would: `frames` to its reply
    subject, `records` to its request log."""
    names = client.names
    sub = await client.js.pull_subscribe(
        names.jobs("generate", "m"), durable=f"newer-{uuid.uuid4().hex[:6]}", stream=names.jobs_stream
    )
    msg = (await sub.fetch(1, timeout=10))[0]
    job = codec.request_decoder.decode(msg.data, codec.encoding_of(msg.headers))
    for record in records:
        await client.js.publish(names.request_log(job.request_id), codec.encode(record))
    for frame in frames:
        await client.nc.publish(
            job.reply_to,
            codec.encode({**frame, "request_id": job.request_id} if "request_id" in frame else frame),
        )
    await msg.ack()


@pytest.mark.anyio
async def test_a_client_reads_a_newer_workers_stream(client):
    accepted = with_new_fields(AcceptedFrame(seq=0, request_id="r", worker="w9", model="m"))
    progress = {"kind": "progress", "seq": 0, "queue_position": 2, **NEW}
    tokens = with_new_fields(TokensFrame(seq=1, token_ids=[5, 6]))
    final = with_new_fields(FinalFrame(seq=2, request_id="r", choices=[CHOICE], usage=USAGE))
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_one_job, client, [accepted, progress, tokens, progress, final])
        seen = [f async for f in client.generate(req("m"))]
    assert [type(f) for f in seen] == [AcceptedFrame, TokensFrame, FinalFrame]  # the unknown kind is skipped
    assert seen[1].token_ids == [5, 6] and seen[2].usage == USAGE and seen[2].choices == [CHOICE]


@pytest.mark.anyio
async def test_a_new_error_code_reaches_the_caller_as_sent(client):
    rid = f"r-{uuid.uuid4().hex}"
    accepted = with_new_fields(AcceptedFrame(seq=0, request_id=rid, worker="w9", model="m"))
    error = {
        **with_new_fields(ErrorFrame(seq=1, request_id=rid, code=ErrorCode.INTERNAL, message="melted")),
        "code": NEW_CODE,
    }
    result = {"kind": "result", "attempt": 1, "error": error, "worker": "w9", **NEW}
    paused = {"kind": "paused", "attempt": 1, "until": 3.0}  # a record kind this version does not know
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_one_job, client, [accepted, error], [paused, result, paused])
        with pytest.raises(RequestFailed) as e:
            await client.complete(req("m", request_id=rid))
    assert e.value.code == NEW_CODE and not e.value.code.known and NEW_CODE in str(e.value)
    stored = await client.result(rid)  # the log ends in a record of an unknown kind: the result is before it
    assert stored is not None and stored.error is not None and stored.error.code.value == NEW_CODE
    attached = [f async for f in client.attach(rid)]
    assert [type(f) for f in attached] == [ErrorFrame] and attached[0].code == NEW_CODE


@pytest.mark.anyio
async def test_a_worker_continues_a_request_whose_log_ends_in_a_record_kind_it_does_not_know(
    nats_url, client
):
    """A newer worker wrote a record of a new kind last, then died: an older worker takes the job
    over from the records it can read, and the unknown one is left out."""
    from jetllm.schemas import Claim, Step, TokensFrame

    from .conftest import inproc_worker
    from .fake_engine import FakeEngine
    from .jobs import req

    job = req("fake", max_tokens=5, max_migrations=5)
    subject = client.names.request_log(job.request_id)
    js = client.nc.jetstream()
    await js.publish(subject, codec.encode(Claim(attempt=1, worker="newer", at=0.0)))
    await js.publish(
        subject, codec.encode(Step(attempt=1, frame=TokensFrame(seq=1, attempt=1, token_ids=[7])))
    )
    await js.publish(subject, codec.encode({"v": 1, "kind": "checkpoint", "attempt": 1, "blocks": [1, 2]}))
    async with inproc_worker(nats_url, FakeEngine(), namespace=client.names.namespace):
        done = await client.complete(job)
    assert done.token_ids[0] == 7 and len(done.token_ids) == 5  # continued after the delivered token


@pytest.mark.anyio
async def test_a_cancel_an_older_producer_stored_in_the_request_log_still_drops_the_job(nats_url, client):
    """Producers of the previous version stored their durable cancel in the request log; where the
    server still lets them (no auth), a worker of this version honours it while queued."""
    from jetllm.schemas import Cancelled, ErrorCode

    from .conftest import inproc_worker
    from .fake_engine import FakeEngine
    from .jobs import req

    job = req("fake", max_tokens=5)
    await client.submit(job)
    await client.js.publish(
        client.names.request_log(job.request_id), codec.encode(Cancelled(attempt=0, reason="older"))
    )
    async with inproc_worker(nats_url, FakeEngine(), namespace=client.names.namespace) as w:
        result = await client.wait_result(job.request_id, timeout=20)
        assert (w.counters.cancelled, w.counters.completed) == (1, 0)
    assert (
        result.error is not None
        and result.error.code == ErrorCode.CANCELLED
        and "older" in result.error.message
    )
