"""Frames come from outside the producer: whoever may publish to its inbox can send anything, and
so are the Results in the request log (whoever may publish there). A producer must end such a
request with a typed error, or drop the frame, never fail with an IndexError or a decode error of
its own. Here the test itself plays the worker."""

from __future__ import annotations

import uuid

import anyio
import pytest

from jetllm.errors import AcceptTimeout, RequestFailed
from jetllm.producer import Client
from jetllm.producer.completion import Completion
from jetllm.schemas import (
    AcceptedFrame,
    Choice,
    ErrorCode,
    FinalFrame,
    GenerateRequest,
    Result,
    SamplingOptions,
    TokensFrame,
    TokensPrompt,
    Usage,
)
from jetllm.subjects import codec

pytestmark = pytest.mark.anyio


def accepted(job_ack: str | None = None, worker: str = "w1") -> bytes:
    return codec.encode(
        AcceptedFrame(seq=0, attempt=1, request_id="r", worker=worker, model="m", job_ack=job_ack)
    )


def final(seq: int, *indexes: int) -> bytes:
    choices = [Choice(index=i, finish_reason="length", completion_tokens=1) for i in indexes]
    return codec.encode(
        FinalFrame(
            seq=seq, request_id="r", choices=choices, usage=Usage(prompt_tokens=3, completion_tokens=1)
        )
    )


def tokens(seq: int, index: int = 0) -> bytes:
    return codec.encode(TokensFrame(seq=seq, token_ids=[5], index=index))


async def played(
    client: Client, frames: list[bytes], *, n: int = 1, stored: Result | None = None, **kwargs
) -> Completion:
    """complete() on a request whose frames are `frames`, sent to its reply subject by hand; with
    `stored`, that Result is in its request log first."""
    jobs = await client.nc.subscribe(client.names.jobs("generate", "m"))
    request = GenerateRequest(
        request_id=f"r-{uuid.uuid4().hex[:8]}",
        model="m",
        prompt=TokensPrompt(token_ids=[1, 2, 3]),
        sampling=SamplingOptions(n=n, temperature=1.0),
    )

    async def worker() -> None:
        job = codec.request_decoder.decode((await jobs.next_msg(timeout=10)).data)
        if stored is not None:
            await client.js.publish(client.names.request_log(job.request_id), codec.encode(stored))
        for frame in frames:
            await client.nc.publish(job.reply_to, frame)

    outcome: Completion | Exception
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)
            with anyio.fail_after(20):
                try:
                    outcome = await client.complete(request, **kwargs)
                except (RequestFailed, AcceptTimeout, ValueError) as exc:  # raised below, outside the group
                    outcome = exc
    finally:
        await jobs.unsubscribe()
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


@pytest.mark.parametrize(
    "frames, n, message",
    [
        pytest.param(
            [accepted(), tokens(1, index=3), final(2, 0)],
            1,
            "names choice 3",
            id="a choice the request lacks",
        ),
        pytest.param(
            [accepted(), tokens(1, index=-1), final(2, 0)], 1, "names choice -1", id="a negative choice"
        ),
        pytest.param(
            [accepted(), tokens(1), final(2, 0, 1)],
            1,
            "names choice 1",
            id="a final frame with an extra choice",
        ),
        pytest.param(
            [accepted(), tokens(1), final(2)], 1, "lacks choice 0", id="a final frame without choices"
        ),
        pytest.param(
            [accepted(), tokens(1), final(2, 0, 0)],
            1,
            "names choice 0 more than once",
            id="a final frame naming a choice twice",
        ),
        pytest.param(
            [accepted(), tokens(1), tokens(2, index=1), final(3, 0)],
            2,
            "lacks choice 1; the request has 2 (0..1)",
            id="n=2: a final frame missing a choice",
        ),
        pytest.param(
            [accepted(), tokens(1), tokens(2, index=1), final(3, 1, 1)],
            2,
            "lacks choice 0",
            id="n=2: a final frame naming one choice twice and missing the other",
        ),
    ],
)
async def test_a_frame_naming_a_choice_the_request_lacks_fails_it_with_a_typed_error(
    client, frames, n, message
):
    with pytest.raises(RequestFailed) as failed:
        await played(client, frames, n=n)
    assert failed.value.code == ErrorCode.INTERNAL and message in str(failed.value)


async def test_a_final_frame_naming_each_choice_once_in_any_order_completes(client):
    done = await played(client, [accepted(), tokens(1, index=1), tokens(2), final(3, 1, 0)], n=2)
    assert [c.token_ids for c in done.choices] == [[5], [5]]


def _stored(token_ids: list[list[int]], text: list[str] | None, *indexes: int) -> Result:
    end = codec.frame_decoder.decode(final(9, *indexes))
    assert isinstance(end, FinalFrame)
    return Result(attempt=1, final=end, token_ids=token_ids, text=text)


FORGED_RESULTS = [
    pytest.param(
        _stored([[5], [6]], ["a"], 0, 1),
        2,
        "1 entries of text for 2 choices",
        id="text shorter than token_ids",
    ),
    pytest.param(
        _stored([[5], [6]], ["a", "b"], 0),
        2,
        "its final frame lacks choice 1",
        id="a final frame missing a choice",
    ),
    pytest.param(
        _stored([[5], [6]], ["a", "b"], 0, 1),
        1,
        "the output of 2 choices; the request has 1",
        id="more choices than the request has",
    ),
]


@pytest.mark.parametrize("result, n, message", FORGED_RESULTS)
async def test_a_forged_result_that_fills_a_gap_fails_the_request_with_a_typed_error(
    client, result, n, message
):
    """The final frame at seq 3 reveals that seq 2 was lost: the producer reads the log, and its
    Result is forged (anyone who may publish to the log can write one)."""
    with pytest.raises(RequestFailed) as failed:
        await played(client, [accepted(), tokens(1), final(3, *range(n))], n=n, stored=result)
    assert failed.value.code == ErrorCode.INTERNAL and message in str(failed.value)


@pytest.mark.parametrize("result, n, message", FORGED_RESULTS)
async def test_a_forged_result_read_after_the_worker_is_gone_fails_the_request_with_a_typed_error(
    client, result, n, message
):
    """The worker falls silent and its ping has no responders: the producer reads the log before it
    moves the job on, and finds a forged Result there."""
    with pytest.raises(RequestFailed) as failed:
        await played(client, [accepted(worker="ghost"), tokens(1)], n=n, stored=result)
    assert failed.value.code == ErrorCode.INTERNAL and message in str(failed.value)


async def test_unreadable_bytes_on_the_inbox_are_dropped_and_the_request_completes(client):
    done = await played(client, [accepted(), b"\xc1", b"{}", tokens(1), final(2, 0)])
    assert done.token_ids == [5] and done.finish_reason == "length"


async def test_a_job_ack_that_is_no_subject_does_not_end_the_stream_with_a_client_error(client):
    """A worker nobody answers for is given up on, and its job handed back by the subject its frame
    named; when that is no valid subject, the job moves after ack_wait instead, and the producer
    goes on waiting (here: until its accept_timeout, a typed error)."""
    bad = f"$JS.ACK.{client.names.jobs_stream}.x y"
    with pytest.raises(AcceptTimeout):
        await played(client, [accepted(job_ack=bad, worker="ghost")], accept_timeout=3)


@pytest.mark.parametrize("own", [True, False], ids=["under the client's inbox root", "elsewhere"])
async def test_generate_refuses_a_reply_subject_set_by_the_caller(client, own):
    """Frames sent there would reach none of this call's inboxes: it would wait forever (even under
    the client's own root, whose inboxes are opened per call)."""
    reply_to = client._inboxes.subject("mine") if own else client.nc.new_inbox()
    req = GenerateRequest(
        request_id="r-own", model="m", prompt=TokensPrompt(token_ids=[1]), reply_to=reply_to
    )
    with pytest.raises(ValueError, match="leave it None"):
        await client.complete(req)
