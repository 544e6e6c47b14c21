"""Dead-lettering: a job that cannot or must not run again leaves the queue for the dead-letter
stream, with its reason, and its producer gets an error frame instead of silence.

Two ways in: the worker rejects a job it holds (bad input, a spent migration budget, an engine
error, a bug), or JetStream announces that a job ran out of deliveries. Either way the error is
stored as the request's result before the job leaves the queue, so a resubmission of the request
is answered from it rather than run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from nats.aio.msg import Msg

from ..errors import JetllmError, RequestRejected
from ..schemas import ErrorCode, Result
from ..subjects import codec
from .frames import FrameSink
from .jobs import Job, RejectedJob, dead_letter_record, decode_request, salvage

if TYPE_CHECKING:
    from .runtime import Worker

log = logging.getLogger(__name__)


class DeadLetters:
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def reject(
        self, job: Job, frames: FrameSink, exc: JetllmError, request_id: str | None,
        code: ErrorCode | None = None,
    ) -> None:
        """Error frame to the producer, the job to the dead-letter stream, then terminate it.

        Never raises: a step that fails is logged and the rest still happens, and a job that
        cannot be dead-lettered is handed back rather than lost.
        """
        w = self.w
        code = code or exc.code
        w.errors[code.value] += 1
        which = request_id or f"seq {job.stream_seq}"
        log.info("request %s rejected: %s: %s", which, code.value, exc.message)
        with anyio.CancelScope(shield=True):
            err = frames.error_frame(code, exc.message, field=exc.field)
            if request_id:
                try:
                    await w.log.store_result(request_id, Result(attempt=job.attempt, error=err, worker=w.instance))
                except Exception as exc2:  # a resubmission may run again; the producer still hears why
                    log.warning("request %s: error result not stored: %s", request_id, exc2)
            await frames.send(err)
            try:
                record = dead_letter_record(
                    subject=job.msg.subject, payload=job.msg.data, headers=job.msg.headers, code=code,
                    reason=exc.message, worker=w.instance, deliveries=job.attempt, request_id=request_id,
                    max_payload=w.nc.max_payload,
                )
                await w.js.publish(
                    w.names.dlq(w.role.role, w.model),
                    codec.encode(record),
                    headers={"Nats-Msg-Id": f"dlq-{w.names.jobs_stream}-{job.stream_seq}"},
                )
            except Exception as exc2:  # keep the job rather than lose it
                log.error("dead-lettering seq %d failed (%s); handing it back", job.stream_seq, exc2)
                await job.nak(delay=w.config.policy.ack_wait)
                return
            w.counters["dead_lettered"] += 1
            await job.term()

    async def fail(self, job: Job, frames: FrameSink | None, exc: Exception, request_id: str | None) -> None:
        """The fault barrier: an unexpected exception while handling one job fails that job only.

        The producer gets one `internal` error frame saying what failed (none if it already had
        its terminal frame), the job goes to the dead-letter stream with the exception's type, the
        traceback is logged once, and the worker serves the next job.
        """
        what = f"jetllm failed while {job.stage}: {type(exc).__name__}: {exc}"[:2000]
        which = request_id or f"seq {job.stream_seq}"
        log.error("request %s: %s", which, what, exc_info=exc)
        if job.settled:
            return
        try:
            if frames is None:
                request_id, reply_to, encoding = salvage(job.msg.data, job.msg.headers)
                frames = FrameSink(self.w.nc, reply_to, encoding, request_id or "", attempt=job.attempt)
            await self.reject(job, frames, RequestRejected(ErrorCode.INTERNAL, what), request_id)
        except Exception:  # nothing more can be done here; JetStream redelivers after ack_wait
            log.exception("request %s: the failed job could not be settled", which)

    async def on_max_deliveries(self, msg: Msg) -> None:
        """JetStream gave up on a job: dead-letter it and tell its producer (every worker of the
        model hears this; the dead letter's message id makes the copies collapse into one)."""
        w = self.w
        try:
            seq = int(msgspec.json.decode(msg.data)["stream_seq"])
            raw = await w.js.get_msg(w.names.jobs_stream, seq)  # nats-py: fields Optional (ignored below)
        except Exception:
            return
        reason = f"JetStream delivered the job {w.config.policy.max_deliver} times and no worker finished it"
        request_id = reply_to = None
        encoding: Any = "msgpack"
        try:
            req, encoding = decode_request(raw.data, raw.headers)  # type: ignore[arg-type]
            request_id, reply_to = req.request_id, req.reply_to
        except RejectedJob as exc:
            request_id, reply_to, encoding = exc.request_id, exc.reply_to, exc.encoding
        frames = FrameSink(w.nc, reply_to, encoding, request_id or "")
        frames.seq = 1_000_000  # after anything the producer saw
        err = frames.error_frame(ErrorCode.DELIVERIES_EXHAUSTED, reason)
        record = dead_letter_record(
            subject=raw.subject or "", payload=raw.data or b"", headers=raw.headers,
            code=ErrorCode.DELIVERIES_EXHAUSTED, reason=reason, worker=w.instance,
            deliveries=w.config.policy.max_deliver, request_id=request_id, max_payload=w.nc.max_payload,
        )
        try:
            await w.js.publish(
                w.names.dlq(w.role.role, w.model), codec.encode(record),
                headers={"Nats-Msg-Id": f"dlq-{w.names.jobs_stream}-{seq}"},
            )
            if request_id:
                await w.log.store_result(request_id, Result(attempt=0, error=err, worker=w.instance))
            await frames.send(err)
            await w.js.delete_msg(w.names.jobs_stream, seq)
        except Exception as exc:
            log.warning("dead-lettering exhausted job seq %d failed: %s", seq, exc)
            return
        w.counters["dead_lettered"] += 1
        log.warning("job seq %d (request %s) ran out of deliveries: dead-lettered", seq, request_id)
