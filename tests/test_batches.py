"""OpenAI-style files and batches on the light test engine: the endpoints through the real
`openai` SDK, the runner's decisions as tables, and a runner SIGKILLed mid-batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import httpx
import msgspec
import openai
import pytest
from starlette.applications import Starlette

from jetllm.batches import held, plan, transitions
from jetllm.batches import lines as lines_module
from jetllm.batches import service as service_module
from jetllm.batches.lines import BadInput, line_request_id, parse_input
from jetllm.batches.runner import BatchRunner
from jetllm.batches.service import BatchService, TooLarge
from jetllm.gateway import batches_api, files_api
from jetllm.openai.endpoints import CHAT, COMPLETIONS, prepare
from jetllm.producer import Client
from jetllm.schemas import BatchIssue, BatchState, RequestCounts
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_streams

from .conftest import inproc_worker
from .fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parent.parent
ACK_WAIT = 2.0

pytestmark = pytest.mark.anyio


def chat_line(i: int, model: str = "fake", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 6, **extra}
    return {"custom_id": f"req-{i}", "method": "POST", "url": CHAT, "body": body}


DEEP = b"[" * 5000 + b"]" * 5000
"""JSON nested deeper than any decoder's recursion limit."""


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


# the runner's decisions


@pytest.mark.parametrize(
    "status, now, expires, action",
    [
        ("validating", 10, 100, "run"),
        ("in_progress", 10, 100, "run"),  # a runner died: resume
        ("finalizing", 10, 100, "run"),  # died while writing the files: write them again
        ("finalizing", 200, 100, "run"),  # every line ran; expiry no longer applies
        ("cancelling", 10, 100, "cancel"),
        ("in_progress", 100, 100, "expire"),
        ("validating", 200, 100, "expire"),
        ("completed", 10, 100, "skip"),
        ("failed", 10, 100, "skip"),
        ("cancelled", 10, 100, "skip"),
        ("expired", 200, 100, "skip"),
    ],
)
def test_what_a_runner_does_with_a_batch_it_takes(status, now, expires, action):
    assert plan.on_take(status, now, expires) == action


@pytest.mark.parametrize(
    "status, now, expires, stop",
    [("in_progress", 1, 2, None), ("cancelling", 1, 2, "cancel"), ("in_progress", 2, 2, "expire")],
)
def test_why_a_running_batch_stops(status, now, expires, stop):
    assert plan.stop_reason(status, now, expires) == stop


def _state(status: str, **kw) -> BatchState:
    return BatchState(
        id="batch_0123abcd", endpoint=CHAT, input_file_id="file-1", completion_window="24h",
        status=status, created_at=1, expires_at=100, **kw,
    )  # fmt: skip


SOME = RequestCounts(total=4, completed=2, failed=1)


@pytest.mark.parametrize(
    "state, change, status, changed",
    [
        (_state("validating"), "started", "in_progress", {"in_progress_at": 50, "runner": "r2"}),
        (
            _state("in_progress", in_progress_at=5, runner="r1"),
            "started",
            "in_progress",
            {"in_progress_at": 5},
        ),
        (_state("cancelling"), "started", None, {}),  # its runner cancels it instead
        (_state("finalizing"), "started", None, {}),  # every line ran: only its files are written again
        (_state("in_progress"), "counted", "in_progress", {"request_counts": SOME}),
        (_state("cancelling"), "counted", None, {}),
        (_state("in_progress"), "finalizing", "finalizing", {"finalizing_at": 50}),
        (_state("cancelling"), "finalizing", None, {}),  # the cancel came first
        (_state("in_progress"), "failed", "failed", {"failed_at": 50, "request_counts": SOME}),
        (_state("validating", request_counts=SOME), "failed-keeping", "failed", {"request_counts": SOME}),
        (_state("expired"), "failed", None, {}),
        (_state("finalizing"), "ended", "completed", {"completed_at": 50, "output_file_id": "out"}),
        (_state("cancelling"), "ended", "cancelled", {"cancelled_at": 50}),  # the cancel is asked last
        (_state("in_progress"), "expired", "expired", {"expired_at": 50, "error_file_id": "err"}),
        (_state("completed"), "ended", None, {}),
        (_state("cancelled"), "expired", None, {}),
    ],
)
def test_how_a_runner_changes_a_batchs_state(state, change, status, changed):
    issue = BatchIssue(code="invalid_input", message="no", param="input_file_id")
    new = {
        "started": lambda s: transitions.started(s, runner="r2", counts=SOME, now=50),
        "counted": lambda s: transitions.counted(s, counts=SOME),
        "finalizing": lambda s: transitions.finalizing(s, now=50),
        "failed": lambda s: transitions.failed(s, issue=issue, counts=SOME, now=50),
        "failed-keeping": lambda s: transitions.failed(s, issue=issue, counts=None, now=50),
        "ended": lambda s: transitions.ended(
            s, stop="done", output_file_id="out", error_file_id=None, counts=SOME, now=50
        ),
        "expired": lambda s: transitions.ended(
            s, stop="expire", output_file_id=None, error_file_id="err", counts=SOME, now=50
        ),
    }[change](state)
    if status is None:
        assert new is None
        return
    assert new.status == status
    assert {k: getattr(new, k) for k in changed} == changed
    assert new.errors == ([issue] if status == "failed" else state.errors)


@pytest.mark.parametrize(
    "pending, queued, in_flight, window, most, submit",
    [
        (100, 0, 0, 8, 4096, 8),
        (100, 8, 8, 8, 4096, 0),  # the window is full of jobs no worker has taken
        (100, 5, 5, 8, 4096, 3),
        (100, 0, 300, 8, 4096, 8),  # running jobs do not count: the batch takes every free slot
        (100, 2, 300, 8, 4096, 6),
        (2, 0, 0, 8, 4096, 2),
        (0, 3, 3, 8, 4096, 0),
        (5, 9, 9, 8, 4096, 0),
        (100, 0, 4094, 8, 4096, 2),  # the runner follows at most `most` lines
        (100, 0, 5000, 8, 4096, 0),
    ],
)
def test_the_window_bounds_the_jobs_of_a_batch_in_the_queue(pending, queued, in_flight, window, most, submit):
    assert plan.to_submit(pending, queued, in_flight, window, most) == submit


@pytest.mark.parametrize(
    "pending, queued, in_flight, freed, most, submit",
    [
        (1000, 8, 8, 256, 4096, 256),  # a wave of lines ended together: their slots refill at once
        (1000, 8, 8, 0, 4096, 0),  # otherwise a full window waits for claims
        (1000, 200, 200, 256, 4096, 64),  # replacements no worker took yet count against the widening
        (1000, 300, 300, 256, 4096, 0),  # others took those slots: the queue stays within window + freed
        (10, 0, 0, 256, 4096, 10),
        (1000, 0, 4000, 256, 4096, 96),  # `most` still bounds what the batch follows
    ],
)
def test_lines_that_just_ended_widen_the_window_by_the_slots_they_left(
    pending, queued, in_flight, freed, most, submit
):
    assert plan.to_submit(pending, queued, in_flight, 8, most, freed) == submit


def _instance(
    model="m", state="serving", slots=8, in_flight=3, ready=True, role="generate", adapters=(), shard_lines=0
):
    from jetllm.schemas import InstanceRecord

    return InstanceRecord(
        instance=f"i-{model}-{state}-{role}-{shard_lines}",
        role=role,
        model=model,
        state=state,
        slots=slots,
        in_flight=in_flight,
        ready=ready,
        adapters=list(adapters),
        shard_lines=shard_lines,
    )


@pytest.mark.parametrize(
    "records, models, free",
    [
        ([_instance()], {"m"}, 5),
        ([_instance(), _instance(in_flight=0, role="decode")], {"m"}, 13),
        ([_instance(model="other")], {"m"}, 0),  # another model's slots are not this batch's
        ([_instance(model="base", adapters=["m"])], {"m"}, 5),  # an adapter the worker has loaded
        ([_instance(state="draining"), _instance(ready=False), _instance(role="prefill")], {"m"}, 0),
        ([_instance(in_flight=12)], {"m"}, 0),
    ],
)
def test_a_batch_starts_with_the_slots_the_registry_says_are_free(records, models, free):
    assert plan.free_slots(records, models) == free


@pytest.mark.parametrize(
    "queued, submitted, spent",
    [
        (0, 8, 0),  # within the window
        (8, 256, 256),  # all beyond it: one freed slot each
        (4, 10, 6),
        (12, 5, 5),  # the queue was already beyond it
        (3, 0, 0),
    ],
)
def test_jobs_beyond_the_window_spend_one_freed_slot_each(queued, submitted, spent):
    assert plan.widened_by(queued, submitted, 8) == spent


@pytest.mark.parametrize(
    ("duplicate", "reconnected", "since_read", "read"),
    [
        (False, False, 0.0, False),  # a fresh line: its result comes on the subscription
        (False, False, 59.0, False),
        (False, False, plan.RESULT_RECHECK, True),  # the safety net for a dropped record
        (True, False, 0.0, True),  # an earlier runner's job may have ended before we subscribed
        (False, True, 0.0, True),  # a record may have gone by while we were away
    ],
)
def test_when_a_waiting_line_reads_its_result_directly(duplicate, reconnected, since_read, read):
    assert plan.read_result(duplicate=duplicate, reconnected=reconnected, since_read=since_read) is read


@pytest.mark.parametrize(
    "text, seconds", [("24h", 86400), ("1h", 3600), ("90m", 5400), ("5s", 5), ("168h", 604800)]
)
def test_completion_windows(text, seconds):
    assert plan.parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "0h", "1d", "169h", "-1h", "24 h"])
def test_bad_completion_windows_are_refused_naming_the_form(text):
    with pytest.raises(ValueError, match="24h"):
        plan.parse_window(text)


@pytest.mark.parametrize(
    "after, limit, ids, more",
    [
        (None, 2, ["a", "b"], True),
        ("b", 2, ["c", "d"], True),
        ("d", 2, ["e"], False),
        (None, 10, list("abcde"), False),
    ],
)
def test_pages(after, limit, ids, more):
    assert plan.page(list("abcde"), after, limit, key=lambda x: x) == (ids, more)


def test_line_request_ids_are_fixed_per_line_and_valid_request_ids():
    rid = line_request_id("batch_0123abcd", 17)
    assert rid == line_request_id("batch_0123abcd", 17) != line_request_id("batch_0123abcd", 18)
    prepare(COMPLETIONS, {"model": "m", "prompt": "x"}, rid)  # passes the RequestId pattern


# input files (the bodies' translation is tabled in test_openai.py)


@pytest.mark.parametrize(
    "content, line, param",
    [
        (jsonl([chat_line(1)]) + b"{not json\n", 2, None),
        (jsonl([chat_line(1), chat_line(2), chat_line(1)]), 3, "custom_id"),
        (jsonl([chat_line(1), {**chat_line(2), "method": "GET"}]), 2, "method"),
        (jsonl([{**chat_line(1), "url": COMPLETIONS}]), 1, "url"),
        (jsonl([chat_line(1), {k: v for k, v in chat_line(2).items() if k != "custom_id"}]), 2, "custom_id"),
        (jsonl([chat_line(1), chat_line(2, temperature=5)]), 2, "body.temperature"),
        (jsonl([chat_line(1)]) + b"\n" + jsonl([chat_line(3, model="")]), 3, "body.model"),
        (jsonl([chat_line(1)]) + jsonl([chat_line(2)]).replace(b"line 2", b"line \xff"), 2, None),
        (jsonl([chat_line(1, chat_template_kwargs={"a": "DEEP"})]).replace(b'"DEEP"', DEEP), 1, None),
        (jsonl([chat_line(1), chat_line(2, seed=2**70)]), 2, "body.seed"),
        (jsonl([chat_line(1, chat_template_kwargs={"a": 2**70})]), 1, "body.chat_template_kwargs"),
    ],
)
def test_a_bad_input_file_names_its_first_bad_line(content, line, param):
    with pytest.raises(BadInput) as info:
        parse_input(content, CHAT)
    assert info.value.line == line
    assert f"line {line}" in info.value.message
    assert info.value.param == param


# the endpoints, through the OpenAI SDK


@pytest.fixture
async def api(nats_url, namespace):
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as client:
        service = await BatchService.open(client.js, client.names, ack_wait=ACK_WAIT, max_file_bytes=64 << 10)
        app = Starlette(routes=files_api.routes(lambda: service) + batches_api.routes(lambda: service))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            sdk = openai.AsyncOpenAI(
                base_url="http://gateway/v1", api_key="none", http_client=http, max_retries=0
            )
            yield sdk, client, service


async def test_files_crud_with_the_openai_sdk(api):
    sdk, _, _ = api
    content = jsonl([chat_line(i) for i in range(3)])
    up = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
    assert (up.filename, up.purpose, up.bytes, up.object) == ("in.jsonl", "batch", len(content), "file")
    other = await sdk.files.create(file=("b.jsonl", b'{"x": 1}\n'), purpose="batch")
    listed = [f.id async for f in sdk.files.list()]
    assert set(listed) == {up.id, other.id}
    assert listed[0] == other.id or listed == sorted(listed, reverse=True)  # newest first
    assert (await sdk.files.retrieve(up.id)).bytes == len(content)
    assert (await sdk.files.content(up.id)).content == content
    deleted = await sdk.files.delete(up.id)
    assert deleted.deleted and deleted.id == up.id
    with pytest.raises(openai.NotFoundError, match=up.id):
        await sdk.files.retrieve(up.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.files.content(up.id)
    assert [f.id async for f in sdk.files.list()] == [other.id]


async def test_uploads_are_bounded_and_need_a_known_purpose(api):
    sdk, _, _ = api
    with pytest.raises(openai.APIStatusError) as info:
        await sdk.files.create(file=("big.jsonl", b"x" * (65 << 10)), purpose="batch")
    assert info.value.status_code == 413
    assert "--max-file-bytes" in info.value.message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await sdk.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")


async def test_a_bad_input_file_is_refused_at_creation_naming_the_line(api):
    sdk, _, _ = api
    f = await sdk.files.create(
        file=("in.jsonl", jsonl([chat_line(1), chat_line(2), chat_line(1)])), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert "line 3" in info.value.message and "req-1" in info.value.message
    assert info.value.body["param"] == "custom_id"
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1 day")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="file-nope"):
        await sdk.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    assert (await sdk.batches.list()).data == []


async def test_batches_create_retrieve_list_and_cancel_without_a_runner(api):
    sdk, _, _ = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(4)])), purpose="batch")
    created = [
        await sdk.batches.create(
            input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"n": str(i)}
        )
        for i in range(3)
    ]
    first = created[0]
    assert first.status == "validating" and first.request_counts.total == 4
    assert first.metadata == {"n": "0"} and first.expires_at == first.created_at + 86400
    got = await sdk.batches.retrieve(first.id)
    assert (got.id, got.input_file_id, got.endpoint) == (first.id, f.id, CHAT)
    page = await sdk.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    everything = [b.id async for b in sdk.batches.list(limit=2)]  # the SDK follows `after`
    assert sorted(everything) == sorted(b.id for b in created)
    cancelled = await sdk.batches.cancel(first.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    assert (await sdk.batches.cancel(first.id)).status == "cancelling"  # again: no change
    with pytest.raises(openai.NotFoundError):
        await sdk.batches.retrieve("batch_0000000000")


def counting_engine(**kw) -> FakeEngine:
    engine = FakeEngine(**kw)
    engine.calls = Counter()  # type: ignore[attr-defined]
    generate = engine.generate

    def counted(req, *args, **kwargs):
        engine.calls[req.request_id] += 1  # type: ignore[attr-defined]
        return generate(req, *args, **kwargs)

    engine.generate = counted  # type: ignore[method-assign]
    return engine


async def wait_status(sdk, batch_id: str, statuses: set[str], timeout: float = 60):
    with anyio.fail_after(timeout):
        while True:
            b = await sdk.batches.retrieve(batch_id)
            if b.status in statuses:
                return b
            await anyio.sleep(0.1)


async def test_a_batch_runs_on_the_fleet_and_writes_openai_output_and_error_files(api, nats_url, namespace):
    sdk, client, service = api
    lines = [chat_line(i) for i in range(12)]
    lines[4] = chat_line(4, model="fake", max_tokens=1000)  # longer than the fake engine's context: fails
    f = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    await client.js.publish(client.names.batch_queue("junk"), b"\x00not a batch")  # dropped, not fatal
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = counting_engine(max_model_len=256)
    async with inproc_worker(nats_url, engine, namespace=namespace, slots=4), anyio.create_task_group() as tg:
        runner = BatchRunner(client, service, window=3, ack_wait=ACK_WAIT)
        tg.start_soon(runner.serve)
        done = await wait_status(sdk, batch.id, {"completed", "failed"})
        tg.cancel_scope.cancel()
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        12,
        11,
        1,
    )
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).content.splitlines()]
    errors = [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).content.splitlines()]
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(12) if i != 4]  # input order
    first = out[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["request_id"] == line_request_id(batch.id, 1)
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "fake"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 6
    assert [x["custom_id"] for x in errors] == ["req-4"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    output_meta = await sdk.files.retrieve(done.output_file_id)
    assert output_meta.purpose == "batch_output"
    assert max(engine.calls.values()) == 1


def peak_engine(**kw) -> FakeEngine:
    """A fake engine that records the most requests it ever ran at once (`peak`)."""
    engine = FakeEngine(**kw)
    engine.at_once = engine.peak = 0  # type: ignore[attr-defined]
    generate = engine.generate

    async def tracked(req, *args, **kwargs):
        engine.at_once += 1  # type: ignore[attr-defined]
        engine.peak = max(engine.peak, engine.at_once)  # type: ignore[attr-defined]
        try:
            async for out in generate(req, *args, **kwargs):
                yield out
        finally:
            engine.at_once -= 1  # type: ignore[attr-defined]

    engine.generate = tracked  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize(
    "most, refill, peak, beyond",
    [
        (
            plan.MAX_IN_FLIGHT,
            plan.REFILL_SECONDS,
            6,
            6,
        ),  # every free slot; a slot left free is refilled at once
        (plan.MAX_IN_FLIGHT, 0, 6, 0),  # with no refill, the window alone bounds the queue
        (3, plan.REFILL_SECONDS, 3, 6),  # with --batch-max-lines, that many
    ],
)
async def test_a_batch_fills_every_free_slot_and_queues_at_most_its_window(
    api, nats_url, namespace, most, refill, peak, beyond
):
    sdk, client, service = api
    n, slots, window = 30, 6, 2
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(n)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = peak_engine(step_delay=0.05)
    queued: list[int] = []

    async def watch_queue() -> None:
        while True:
            info = await client.js.consumer_info(
                client.names.jobs_stream, client.names.consumer("generate", "fake")
            )
            queued.append(int(info.num_pending or 0))
            await anyio.sleep(0.01)

    async with (
        inproc_worker(nats_url, engine, namespace=namespace, slots=slots),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(watch_queue)
        tg.start_soon(
            BatchRunner(client, service, window=window, most=most, refill=refill, ack_wait=ACK_WAIT).serve
        )
        done = await wait_status(sdk, batch.id, {"completed", "failed"})
        tg.cancel_scope.cancel()
    assert done.status == "completed" and done.request_counts.completed == n
    assert engine.peak == peak  # running lines do not count against the window
    # what an online request can find ahead of it: the window, and a job for each slot just left free
    assert max(queued) <= window + beyond


async def test_cancel_stops_new_lines_and_keeps_what_finished(api, nats_url, namespace):
    sdk, client, service = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(40)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = counting_engine(step_delay=0.05)
    async with inproc_worker(nats_url, engine, namespace=namespace, slots=2), anyio.create_task_group() as tg:
        tg.start_soon(BatchRunner(client, service, window=2, ack_wait=ACK_WAIT).serve)
        with anyio.fail_after(30):
            while (await sdk.batches.retrieve(batch.id)).request_counts.completed < 2:
                await anyio.sleep(0.05)
        await sdk.batches.cancel(batch.id)
        done = await wait_status(sdk, batch.id, {"cancelled"})
        tg.cancel_scope.cancel()
    c = done.request_counts
    assert c.total == 40 and 2 <= c.completed < 40 and c.completed + c.failed == 40
    assert len(engine.calls) < 40  # lines after the cancel never ran
    out = (await sdk.files.content(done.output_file_id)).content.splitlines()
    errors = [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).content.splitlines()]
    assert len(out) + len(errors) == 40  # every line once, in one file or the other
    assert errors[-1]["error"]["code"] == "batch_cancelled" and errors[-1]["response"] is None


async def test_a_batch_past_its_window_expires(api, nats_url, namespace):
    sdk, client, service = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(30)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="2s")  # type: ignore[arg-type]
    async with inproc_worker(nats_url, FakeEngine(step_delay=0.05), namespace=namespace, slots=1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(BatchRunner(client, service, window=1, ack_wait=ACK_WAIT).serve)
            done = await wait_status(sdk, batch.id, {"expired", "completed"})
            tg.cancel_scope.cancel()
    assert done.status == "expired" and done.expired_at
    errors = [json.loads(x) for x in (await sdk.files.content(done.error_file_id)).content.splitlines()]
    assert errors[-1]["error"]["code"] == "batch_expired"
    assert done.request_counts.completed < 30


def start_runner(nats_url: str, namespace: str, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jetllm", "batch-runner", "--nats", nats_url, "--namespace", namespace, *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


async def test_a_runner_killed_mid_batch_is_replaced_and_no_line_runs_twice(
    api, nats_url, namespace, tmp_path
):
    sdk, _, _ = api
    n = 40
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(n)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = counting_engine(step_delay=0.03)
    flags = ("--batch-window", "4", "--batch-ack-wait", str(ACK_WAIT))
    runners = []
    try:
        async with inproc_worker(nats_url, engine, namespace=namespace, slots=4):
            runners.append(start_runner(nats_url, namespace, tmp_path / "runner0.log", *flags))
            with anyio.fail_after(60):
                while (await sdk.batches.retrieve(batch.id)).request_counts.completed < 8:
                    await anyio.sleep(0.05)
            os.killpg(runners[0].pid, signal.SIGKILL)
            runners[0].wait()
            before = (await sdk.batches.retrieve(batch.id)).request_counts.completed
            runners.append(start_runner(nats_url, namespace, tmp_path / "runner1.log", *flags))
            done = await wait_status(sdk, batch.id, {"completed", "failed"}, timeout=90)
    finally:
        for p in runners:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    log1 = (tmp_path / "runner1.log").read_text()
    assert done.status == "completed", log1
    assert before < n
    assert done.request_counts.completed == n
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).content.splitlines()]
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(n)]
    assert len(engine.calls) == n and set(engine.calls.values()) == {1}  # every line ran exactly once
    assert "had finished already" in log1


async def test_jetllm_batch_detaches_follows_and_downloads(api, nats_url, namespace, tmp_path):
    _, client, service = api
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line(i) for i in range(5)]))
    base = [sys.executable, "-m", "jetllm", "batch", "--nats", nats_url, "--namespace", namespace]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    detached = await anyio.run_process([*base, "--detach", str(src)], cwd=ROOT, env=env)
    batch_id = detached.stdout.decode().strip()
    assert batch_id.startswith("batch_")
    async with (
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, slots=4),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(BatchRunner(client, service, ack_wait=ACK_WAIT).serve)
        followed = await anyio.run_process([*base, "--follow", batch_id, "--progress"], cwd=ROOT, env=env)
        tg.cancel_scope.cancel()
    err = followed.stderr.decode()
    assert "5/5 lines" in err and "completed; 5 completed, 0 failed of 5" in err
    out = tmp_path / "out.jsonl"
    await anyio.run_process([*base, "--download", batch_id, str(out)], cwd=ROOT, env=env)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [
        f"req-{i}" for i in range(5)
    ]
    missing = await anyio.run_process([*base, "--follow", "batch_0000000000"], cwd=ROOT, env=env, check=False)
    assert missing.returncode == 1 and "no batch with id" in missing.stderr.decode()


def raw_http(service: BatchService) -> httpx.AsyncClient:
    app = Starlette(routes=files_api.routes(lambda: service) + batches_api.routes(lambda: service))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_a_huge_batch_request_body_is_refused_before_it_is_read_whole(api):
    _, _, service = api

    async def chunked():  # no content-length: refused as it arrives
        for _ in range(64):
            yield b" " * (64 << 10)

    async with raw_http(service) as http:
        declared = await http.post("/v1/batches", content=b"{" + b" " * (2 << 20) + b"}")
        streamed = await http.post("/v1/batches", content=chunked())
    for answer in (declared, streamed):
        assert answer.status_code == 413
        assert "POST /v1/files" in answer.json()["error"]["message"]


@pytest.mark.parametrize(
    "field, value", [("completion_window", 24), ("completion_window", ["24h"]), ("metadata", "x")]
)
async def test_batch_fields_of_the_wrong_type_are_a_400_naming_the_field(api, field, value):
    _, _, service = api
    body = {"input_file_id": "file-x", "endpoint": CHAT, "completion_window": "24h", field: value}
    async with raw_http(service) as http:
        answer = await http.post("/v1/batches", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_an_input_file_with_more_requests_than_a_batch_takes_is_refused_naming_the_line(monkeypatch):
    monkeypatch.setattr(lines_module, "MAX_LINES", 3)
    assert len(parse_input(jsonl([chat_line(i) for i in range(3)]), CHAT)) == 3
    with pytest.raises(BadInput) as info:
        parse_input(b"\n" + jsonl([chat_line(i) for i in range(4)]), CHAT)
    assert info.value.line == 5 and "at most 3 requests" in info.value.message
    assert "split" in info.value.message


async def test_checking_an_input_file_does_not_stop_the_gateways_event_loop(api, monkeypatch):
    sdk, _, service = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(1)])), purpose="batch")
    real = service_module.parse_input

    def slow_parse(data, endpoint):  # a file of 100 MiB takes seconds to check
        time.sleep(1.0)
        return real(data, endpoint)

    monkeypatch.setattr(service_module, "parse_input", slow_parse)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await service.create(f.id, CHAT)
        tg.cancel_scope.cancel()
    assert ticks >= 10


async def test_an_input_object_larger_than_an_upload_may_be_is_not_read(api):
    """Objects can reach the files store other than through the upload (any identity that may
    write it): the gateway reads an input file only after checking its size."""
    _, _, service = api
    data = jsonl([chat_line(i) for i in range(2)]) * 1
    data += b" " * (service.max_file_bytes + 1 - len(data))
    await service.upload(data[: service.max_file_bytes], "ok.jsonl", "batch", "file-big")
    await service.files.put("file-big", data, meta=(await service.files.get_info("file-big")))
    with pytest.raises(TooLarge) as info:
        await service.create("file-big", CHAT)
    assert info.value.param == "input_file_id" and "--max-file-bytes" in info.value.message


async def test_an_unreadable_batch_message_never_ends_the_runner_even_when_it_cannot_be_dropped():
    class Unreadable:
        data = b"not a batch"

        async def term(self):
            raise ConnectionError("server away")

    runner = BatchRunner(None, None)  # type: ignore[arg-type]  # not reached for an unreadable message
    free = anyio.Semaphore(1)
    await free.acquire()
    await runner._hold(Unreadable(), free)  # type: ignore[arg-type]
    assert free.value == 1  # its slot is free for the next batch


async def test_an_upload_without_a_length_is_refused_while_it_arrives(api):
    """Without a content-length, the file part is cut off at the limit, not spooled to disk whole."""
    _, _, service = api
    sent = 0

    async def body():
        nonlocal sent
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        for _ in range(256):  # 16 MiB against a limit of 64 KiB
            sent += 64 << 10
            yield b"x" * (64 << 10)
        yield b"\r\n--b--\r\n"

    async with raw_http(service) as http:
        answer = await http.post(
            "/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=b"}
        )
    assert answer.status_code == 413 and "--max-file-bytes" in answer.json()["error"]["message"]
    assert sent < 1 << 20


async def test_a_malformed_upload_is_a_400_naming_the_file_field(api):
    _, _, service = api
    async with raw_http(service) as http:
        answer = await http.post("/v1/files", content=b"x", headers={"content-type": "multipart/form-data"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "file" and "multipart" in answer.json()["error"]["message"]


async def test_a_batch_whose_output_is_larger_than_an_upload_may_be_completes(api, nats_url, namespace):
    """--max-file-bytes bounds what clients upload, not what a batch answers: an output file past it
    is written, not refused (which put the batch back in the queue to fail the same way forever)."""
    sdk, client, service = api
    lines = [chat_line(i, max_tokens=200) for i in range(80)]
    f = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    async with (
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, slots=8),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(BatchRunner(client, service, window=8, ack_wait=ACK_WAIT).serve)
        done = await wait_status(sdk, batch.id, {"completed", "failed"}, timeout=45)
        tg.cancel_scope.cancel()
    assert (done.status, done.request_counts.completed) == ("completed", 80), done.errors
    output = await sdk.files.retrieve(done.output_file_id)
    assert output.bytes > service.max_file_bytes


@pytest.mark.parametrize("path", ["/v1/batches/batch_{}", "/v1/files/file-{}", "/v1/files/file-{}/content"])
@pytest.mark.parametrize("tail", ["x" * 5000, "." * 20_000])
async def test_an_id_from_a_url_that_no_batch_or_file_can_have_is_a_short_404(api, path, tail):
    """Not a 500 when the id no longer fits a NATS message once encoded, and not an error echoing
    the whole id back."""
    _, _, service = api
    async with raw_http(service) as http:
        answer = await http.get(path.format(tail))
    assert answer.status_code == 404, answer.text[:300]
    error = answer.json()["error"]
    assert len(error["message"]) < 300 and error["param"] in ("batch_id", "file_id")


async def test_an_input_file_id_that_no_file_can_have_is_a_short_404(api):
    _, _, service = api
    async with raw_http(service) as http:
        answer = await http.post("/v1/batches", json={"input_file_id": "." * 900_000, "endpoint": CHAT})
    assert answer.status_code == 404, answer.text[:300]
    error = answer.json()["error"]
    assert len(error["message"]) < 300 and error["param"] == "input_file_id"


@pytest.mark.parametrize(
    "metadata",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {f"k{i}": "v" * 512 for i in range(16)} | {"big": "v" * 900_000},
    ],
)
async def test_batch_metadata_past_openais_limits_is_a_400_naming_it(api, metadata):
    sdk, _, service = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(1)])), purpose="batch")
    async with raw_http(service) as http:
        answer = await http.post(
            "/v1/batches", json={"input_file_id": f.id, "endpoint": CHAT, "metadata": metadata}
        )
    assert answer.status_code == 400, answer.text[:300]
    assert answer.json()["error"]["param"] == "metadata" and "16" in answer.json()["error"]["message"]


# found in review (2026-11-30)


async def _in_progress_with_every_line_queued(client: Client, service: BatchService, data: bytes) -> str:
    """A batch an earlier runner started and submitted every line of, then died: what a runner
    taking it over finds."""
    f = await service.upload(data, "in.jsonl", "batch")
    state = await service.create(f.id, CHAT)
    now = int(time.time())
    await service.update(
        state.id, lambda s: msgspec.structs.replace(s, status="in_progress", in_progress_at=now)
    )
    for line in parse_input(data, CHAT):
        await client.submit(prepare(CHAT, line.body, line_request_id(state.id, line.line)).job.request)
    return state.id


async def _results(client: Client, batch_id: str, n: int) -> dict[int, object]:
    """Every line's result in the request log, once each has one."""
    with anyio.fail_after(60):
        while True:
            found = {i: await client.result(line_request_id(batch_id, i)) for i in range(1, n + 1)}
            if all(r is not None for r in found.values()):
                return found
            await anyio.sleep(0.1)


async def test_cancelling_a_batch_taken_over_stops_the_earlier_runners_jobs(api, nats_url, namespace):
    """The lines the earlier runner queued are cancelled too, not only those this runner
    resubmitted: the batch's output is what the fleet ran, nothing runs for it afterwards."""
    sdk, client, service = api
    n = 12
    batch_id = await _in_progress_with_every_line_queued(
        client, service, jsonl([chat_line(i) for i in range(n)])
    )
    engine = counting_engine(step_delay=0.2)
    async with inproc_worker(nats_url, engine, namespace=namespace, slots=2), anyio.create_task_group() as tg:
        tg.start_soon(BatchRunner(client, service, window=1, refill=0).serve)
        with anyio.fail_after(30):
            while (await service.get(batch_id)).runner is None:
                await anyio.sleep(0.05)
        await sdk.batches.cancel(batch_id)
        done = await wait_status(sdk, batch_id, {"cancelled"})
        results = await _results(client, batch_id, n)
        tg.cancel_scope.cancel()
    ran = {i for i, r in results.items() if r.final is not None}  # type: ignore[attr-defined]
    out = (
        [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).content.splitlines()]
        if done.output_file_id
        else []
    )
    assert {int(x["custom_id"].removeprefix("req-")) + 1 for x in out} == ran
    assert done.request_counts.completed == len(ran) < n


async def test_only_a_runners_ack_wait_sets_the_runners_consumer(nats_url, namespace):
    """`jetllm batch --detach` and a producer open the batch service without an ack_wait: the
    consumer keeps what the runners were given."""
    async with Client(nats_url, namespace=namespace) as client:
        names = client.names

        async def ack_wait() -> float:
            return (
                await client.js.consumer_info(names.batch_queue_stream, names.BATCH_RUNNERS)
            ).config.ack_wait

        await BatchService.open(client.js, names)
        assert await ack_wait() == plan.DEFAULT_ACK_WAIT  # a new namespace
        await BatchService.open(client.js, names, ack_wait=120)  # a runner with --batch-ack-wait 120
        await BatchService.open(client.js, names)  # a detach
        assert await ack_wait() == 120


async def test_a_runner_extends_its_batch_by_the_consumers_ack_wait_not_its_own(
    api, nats_url, namespace, monkeypatch
):
    """A runner given a longer ack_wait than the consumer has (set by the last runner given one)
    keeps its batch: no second runner takes it while it runs."""
    sdk, client, service = api
    takes = []
    run = held.HeldBatch.run

    async def counted(self):
        takes.append(self.runner)
        await run(self)

    monkeypatch.setattr(held.HeldBatch, "run", counted)
    other = await BatchService.open(client.js, client.names, ack_wait=3.0)  # the later runner's flag
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(10)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = counting_engine(step_delay=0.1)
    async with inproc_worker(nats_url, engine, namespace=namespace, slots=1), anyio.create_task_group() as tg:
        tg.start_soon(BatchRunner(client, service, window=1, ack_wait=30.0, instance="A").serve)
        with anyio.fail_after(30):
            while not takes:
                await anyio.sleep(0.05)
        tg.start_soon(BatchRunner(client, other, window=1, ack_wait=3.0, instance="B").serve)
        done = await wait_status(sdk, batch.id, {"completed", "failed"})
        tg.cancel_scope.cancel()
    assert (done.status, done.request_counts.completed) == ("completed", 10)
    assert takes == ["A"]


async def test_a_file_a_batch_that_has_not_ended_reads_cannot_be_deleted(api):
    sdk, _, _ = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(2)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    await sdk.batches.cancel(batch.id)  # cancelling: its runner still writes the output
    with pytest.raises(openai.ConflictError) as info:
        await sdk.files.delete(f.id)
    assert info.value.status_code == 409 and info.value.body["param"] == "file_id"
    assert batch.id in info.value.message and "cancelling" in info.value.message
    assert (await sdk.files.retrieve(f.id)).id == f.id


async def test_cancelling_a_batch_whose_queue_message_was_lost_ends_it_and_frees_its_file(api):
    """A batch left validating with no queue message (its gateway died between the two writes)
    would never end, and its input could never be deleted: a cancel queues it again, so a runner
    takes it and ends it."""
    sdk, client, service = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(2)])), purpose="batch")

    async def died_first(batch_id: str) -> None:  # the gateway died after storing the batch
        pass

    queue, service._queue = service._queue, died_first  # type: ignore[method-assign]
    try:
        batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    finally:
        service._queue = queue  # type: ignore[method-assign]
    assert (await client.js.stream_info(client.names.batch_queue_stream)).state.messages == 0
    await sdk.batches.cancel(batch.id)
    async with anyio.create_task_group() as tg:
        tg.start_soon(BatchRunner(client, service).serve)
        done = await wait_status(sdk, batch.id, {"cancelled"})
        tg.cancel_scope.cancel()
    assert done.request_counts.completed == 0
    await sdk.files.delete(f.id)


async def test_a_resumed_batch_whose_input_is_gone_fails_saying_so_and_cancels_its_queued_lines(
    api, nats_url, namespace
):
    """Deleted by other means than the API: no output can be written, so the batch fails naming
    the file and how many lines had completed, and the lines still queued do not run."""
    sdk, client, service = api
    n = 6
    data = jsonl([chat_line(i) for i in range(n)])
    batch_id = await _in_progress_with_every_line_queued(client, service, data)
    file_id = (await service.get(batch_id)).input_file_id
    await service.files.delete(file_id)
    async with anyio.create_task_group() as tg:
        tg.start_soon(BatchRunner(client, service).serve)
        done = await wait_status(sdk, batch_id, {"completed", "failed"})
        tg.cancel_scope.cancel()
    assert done.status == "failed" and done.errors is not None
    message = done.errors.data[0].message
    assert file_id in message and "deleted" in message and f"0 of {n} lines had completed" in message
    async with inproc_worker(nats_url, FakeEngine(), namespace=namespace, slots=4):
        results = await _results(client, batch_id, n)
    assert {r.error.code for r in results.values()} == {"cancelled"}  # type: ignore[attr-defined]


async def test_a_batch_created_under_a_larger_upload_limit_runs_on_a_runner_with_a_smaller_one(
    api, nats_url, namespace
):
    """A standalone runner has no --max-file-bytes: the gateway's, checked at create, is the limit."""
    sdk, client, service = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(8)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    runners = BatchService(client.js, client.names, service.files, service.states, max_file_bytes=100)
    async with (
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, slots=4),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(BatchRunner(client, runners).serve)
        done = await wait_status(sdk, batch.id, {"completed", "failed"})
        tg.cancel_scope.cancel()
    assert (done.status, done.request_counts.completed) == ("completed", 8), done.errors


async def test_a_completion_window_longer_than_the_namespace_keeps_results_is_refused(api):
    sdk, client, _ = api
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(1)])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="25h")  # type: ignore[arg-type]
    assert info.value.body["param"] == "completion_window"
    assert "24h" in info.value.message and "--max-age" in info.value.message
    await ensure_streams(client.js, client.names, QueuePolicy(max_age=48 * 3600, results_max_age=48 * 3600))
    longer = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="48h")  # type: ignore[arg-type]
    assert longer.expires_at == longer.created_at + 48 * 3600
    await ensure_streams(client.js, client.names, QueuePolicy(max_age=5400, results_max_age=5400))
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="2h")  # type: ignore[arg-type]
    assert "Give at most 90m" in info.value.message  # a window the API takes (not "1.5h")


async def test_a_list_limit_of_other_digits_than_ascii_is_a_400(api):
    _, _, service = api
    async with raw_http(service) as http:
        answer = await http.get("/v1/batches", params={"limit": "²"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit"


def _failing_queue(client: Client, fails: int):
    """`js.publish` that fails the first `fails` publishes of a batch's queue message."""
    publish = client.js.publish
    seen = []

    async def flaky(subject, *args, **kwargs):
        if subject.startswith(client.names.batch_queue_all.removesuffix("*")) and len(seen) < fails:
            seen.append(subject)
            raise TimeoutError("no answer from the stream")
        return await publish(subject, *args, **kwargs)

    return flaky


async def test_a_batch_whose_queue_message_is_not_stored_at_first_is_queued_again(api, monkeypatch):
    sdk, client, _ = api
    monkeypatch.setattr(service_module, "QUEUE_BACKOFF", 0.01)
    monkeypatch.setattr(client.js, "publish", _failing_queue(client, 2))
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(1)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "validating"
    queued = await client.js.stream_info(client.names.batch_queue_stream)
    assert queued.state.messages == 1


async def test_a_batch_that_cannot_be_queued_is_marked_failed_not_left_validating(api, monkeypatch):
    sdk, client, _ = api
    monkeypatch.setattr(service_module, "QUEUE_BACKOFF", 0.01)
    monkeypatch.setattr(client.js, "publish", _failing_queue(client, 1000))
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(1)])), purpose="batch")
    with pytest.raises(openai.InternalServerError) as info:
        await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    assert info.value.status_code == 503 and "create it again" in info.value.message
    (listed,) = (await sdk.batches.list()).data
    assert listed.status == "failed" and listed.errors is not None
    assert "could not be handed to the batch runners" in listed.errors.data[0].message


def service_of(api) -> BatchService:
    return api[2]
