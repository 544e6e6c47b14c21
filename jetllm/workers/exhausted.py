"""Jobs JetStream gave up on (max deliveries): no worker holds them any more, so the advisory
is what answers their producers, with an error frame and a dead letter."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.msg import Msg

from ..schemas import ErrorCode, Result
from ..subjects.names import SHARD_QUEUE
from .context import WorkerContext
from .deadletters import DeadLetters
from .frames import FrameSink
from .jobs import dead_letter_record, salvage
from .requestlog import RequestLog
from .shards import fail_requests

log = logging.getLogger(__name__)


class Exhausted:
    """JetStream gave up on a job (max deliveries): dead-letter it and tell its producer. Every
    worker of the queue hears the advisory; the dead letter's message id makes the copies one."""

    def __init__(self, ctx: WorkerContext, request_log: RequestLog, dead_letters: DeadLetters) -> None:
        self._ctx = ctx
        self._log = request_log
        self._dead_letters = dead_letters

    async def on_advisory(self, msg: Msg) -> None:
        ctx = self._ctx
        try:
            seq = int(msgspec.json.decode(msg.data)["stream_seq"])
            raw = await ctx.js.get_msg(ctx.names.jobs_stream, seq)  # nats-py: fields Optional (ignored below)
        except Exception:
            return
        max_deliver = ctx.policy.max_deliver
        reason = f"JetStream delivered the job {max_deliver} times and no worker finished it"
        # Whom to tell, read as for any job that cannot be decoded: whatever role's job it was.
        request_id, reply_to, encoding = salvage(raw.data, raw.headers)  # type: ignore[arg-type]
        frames = FrameSink(ctx.nc, reply_to, encoding, request_id or "")
        frames.seq = 1_000_000  # after anything the producer saw
        err = frames.error_frame(ErrorCode.DELIVERIES_EXHAUSTED, reason)
        record = dead_letter_record(
            subject=raw.subject or "",
            payload=raw.data or b"",
            headers=raw.headers,
            code=ErrorCode.DELIVERIES_EXHAUSTED,
            reason=reason,
            worker=ctx.instance,
            deliveries=max_deliver,
            request_id=request_id,
            max_payload=ctx.nc.max_payload,
        )
        try:
            await self._dead_letters.publish(record, seq)
        except Exception as exc:
            log.warning("dead-lettering exhausted job seq %d failed: %s", seq, exc)
            return
        # Counted once its record is stored, before the awaits below: whoever hears the producer's
        # error (or reads the dead letter) finds it counted.
        ctx.counters.dead_lettered += 1
        try:
            if raw.subject == ctx.names.jobs(SHARD_QUEUE, ctx.model):  # its requests wait for results
                await fail_requests(
                    ctx, self._log, raw.data or b"", encoding, err, 0
                )  # logs what it could not
            elif request_id:
                await self._log.store_result(request_id, Result(attempt=0, error=err, worker=ctx.instance))
            await frames.send(err)
            await ctx.js.delete_msg(ctx.names.jobs_stream, seq)
        except Exception as exc:
            log.warning("dead-lettering exhausted job seq %d failed: %s", seq, exc)
            return
        log.warning("job seq %d (request %s) ran out of deliveries: dead-lettered", seq, request_id)
