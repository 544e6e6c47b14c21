"""The fault barrier: an unexpected exception at any stage of a job's way through a worker fails
that job only. The producer gets exactly one terminal frame (an `internal` error that says what
failed, or its final frame when the fault came after the end), the job is dead-lettered with the
exception's type, nothing stays in the queue, and the worker serves the next job unchanged.
The same holds for a cancellation no scope of the worker asked for (a library cancelling a future
a job awaits): asyncio raises it like any cancellation, and anyio's task group would take it for
its own and end every job with the worker.

Runs against the light test engine in-process and against a real vLLM worker process whose jobs
can ask for a fault (tests/helpers/faults.py).
"""

from __future__ import annotations

import uuid

import anyio
import pytest

from jetllm.producer import Client
from jetllm.schemas import ErrorCode, ErrorFrame, FinalFrame, TextPrompt
from jetllm.subjects import codec

from .conftest import TINY, inproc_worker
from .fake_engine import FakeEngine
from .helpers import faults
from .jobs import RawInbox, consumer_counts, dead_letters, publish_raw, req, wait_dead_letter

pytestmark = pytest.mark.anyio

WHILE = {
    "decode": "decoding it",
    "log": "reading its request log and rendering its prompt",
    "render": "reading its request log and rendering its prompt",
    "claim": "claiming it in the request log",
    "accepted": "sending its accepted frame",
    "engine": "running it on the engine",
    "tokens": "running it on the engine",
    "result": "storing its result",
    "final": "sending its final frame",
    "trace": None,  # after the end: the producer has its final frame, the job is acked
}
assert set(WHILE) == set(faults.STAGES)


@pytest.fixture(params=["fake", pytest.param("vllm", marks=pytest.mark.vllm)])
async def served(request, nats_url, namespace):
    """(client, model, worker process or None) with faults injectable on the worker."""
    if request.param == "fake":
        with faults.installed(FakeEngine):
            async with Client(nats_url, namespace=namespace) as c:
                async with inproc_worker(nats_url, FakeEngine(), namespace=namespace):
                    yield c, "fake", None
    else:
        worker = request.getfixturevalue("shared_vllm")  # it runs tests/helpers/faulty_worker.py
        async with Client(nats_url, namespace=worker.namespace) as c:
            yield c, TINY, worker


RAISED = {"fault": "InjectedFault", "stray": "StrayCancellation"}
assert set(RAISED) == set(faults.KINDS)


def faulty_job(model: str, kind: str, stage: str, reply_to: str):
    job = req(model, max_tokens=4, request_id=f"{kind}-{stage}-{uuid.uuid4().hex[:8]}", reply_to=reply_to)
    if stage == "render":
        import msgspec

        job = msgspec.structs.replace(job, prompt=TextPrompt(f"{kind}-render: a prompt"))
    return job


async def settled_queue(c: Client, model: str) -> tuple[int, int]:
    with anyio.move_on_after(15):
        while (counts := await consumer_counts(c.nc, c.names, model)) != (0, 0):
            await anyio.sleep(0.05)
    return counts


@pytest.mark.parametrize("kind", faults.KINDS)
@pytest.mark.parametrize("stage", faults.STAGES)
async def test_a_fault_at_any_stage_fails_that_job_only(served, stage, kind):
    c, model, worker = served
    before = await c.complete(req(model, max_tokens=6))

    async with RawInbox(c.nc) as inbox:
        job = faulty_job(model, kind, stage, inbox.subject)
        await publish_raw(c.nc, c.names, model, codec.encode(job))
        frames = await inbox.until_end()
        after = await c.complete(req(model, max_tokens=6))  # the worker serves on, unchanged
        late = []
        while True:  # anything the worker sent after the end would be here by now
            try:
                late.append(codec.frame_decoder.decode((await inbox._sub.next_msg(timeout=0.2)).data))
            except Exception:
                break

    assert after.token_ids == before.token_ids
    terminal = [f for f in frames + late if isinstance(f, FinalFrame | ErrorFrame)]
    assert len(terminal) == 1, frames + late
    end = terminal[0]
    if WHILE[stage] is None:
        assert isinstance(end, FinalFrame), end
        assert not [d for d in await dead_letters(c.nc, c.names) if d.request_id == job.request_id]
    else:
        assert isinstance(end, ErrorFrame), end
        assert end.code == ErrorCode.INTERNAL
        assert f"jetllm failed while {WHILE[stage]}" in end.message and RAISED[kind] in end.message
        dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == job.request_id)
        assert dead.code == ErrorCode.INTERNAL and dead.reason == end.message
        assert dead.payload == codec.encode(job)
    assert await settled_queue(c, model) == (0, 0)
    if worker is not None:
        assert worker.proc.poll() is None, "the worker process exited"
