"""The job protocol: one delivery's way from pull to settle, the same for every role, and the one
layer that answers a job's producer.

A `JobRun` owns its job's frames (a FrameSink nobody else sees) and its acknowledgement. The role
runs the job through it (roles/base.py: `JobHandle`): the request log leads the frames that
matter (a claim before `accepted`, the result before the final frame and the ack) and checkpoints
the token frames; the producer holds the newest, so any other worker can take over from what the
log and the producer say. Everything the job goes through runs
behind the fault barrier in `run`: a typed error (bad input, a spent budget, an engine error) is
rejected (error frame, dead letter, term), any other exception fails this job only (`internal`),
and a job that was interrupted (cancel, takeover, drain, a dead engine) is settled by why: a
cancelled one is terminated with its result stored, the others handed back to migrate. (A job
JetStream gave up on, which no worker holds, is answered by exhausted.py.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.msg import Msg

from .. import taskdump
from ..aio import contained, entered, owned_cancellation
from ..errors import EngineDead, EngineRequestError, JetllmError, RequestRejected
from ..schemas import (
    CancelRequest,
    Choice,
    ChoiceLogprobs,
    Claim,
    Delivered,
    ErrorCode,
    Handoff,
    Result,
    ResumeQuery,
    Steps,
    TokensFrame,
    Usage,
)
from ..subjects import codec
from ..subjects.directed import queue_of
from .context import WorkerContext
from .deadletters import DeadLetters
from .framebatch import FrameBatcher, batch_subject
from .frames import CHECKPOINT_INTERVAL, DETACHED_CHECKPOINT_INTERVAL, FrameSink
from .jobs import Job, RejectedJob, dead_letter_record, salvage
from .pulls import Pulls
from .requestlog import LogUnavailable, RequestLog, contiguous_after
from .roles import Role
from .roles.base import TokenSender
from .running import Running, RunningRequests
from .slots import Slots
from .state import Lifecycle
from .tasks import JobTasks
from .tracing import Hop, TracePublisher, outcome_of

log = logging.getLogger(__name__)

RESUME_QUERY_TIMEOUT = 2.0
"""How long a worker taking a request over waits for its producer's ResumeQuery answer. A live
producer answers as soon as its reader reaches the query; one that is gone answers "no responders" at once."""


@dataclass(frozen=True, slots=True)
class JobDeps:
    """What the protocol needs, shared by every job of the worker."""

    ctx: WorkerContext
    role: Role
    running: RunningRequests
    log: RequestLog
    dead_letters: DeadLetters
    traces: TracePublisher
    tasks: JobTasks
    pulls: Pulls
    lifecycle: Lifecycle
    checkpoint_interval: float = CHECKPOINT_INTERVAL
    detached_checkpoint_interval: float = DETACHED_CHECKPOINT_INTERVAL
    batcher: FrameBatcher | None = None


class JobRun:
    """One delivery, from its bytes to its settlement; the `JobHandle` its role runs it through."""

    __slots__ = ("_d", "job", "request", "request_id", "tokens", "prefill", "_frames", "_run", "_received_at")
    tokens: TokenSender

    def __init__(
        self, deps: JobDeps, msg: Msg, job: Job | None = None, received_at: float | None = None
    ) -> None:
        """`job`: the delivery as the request sees it (a shard's requests share one: shards.py).
        `received_at`: when the connection handed the worker `msg`, for its trace record."""
        self._d = deps
        self._received_at = received_at
        self.job = job or Job(msg)
        self.request: Any = None
        self.request_id = ""
        self.prefill: str | None = None
        self._frames: FrameSink | None = None
        self._run: Running | None = None

    @property
    def fresh(self) -> bool:
        """A job on its own queue may be anything: a redelivery, a resubmission, cancelled."""
        return False

    # the fault barrier

    async def run(self) -> None:
        """Behind the fault barrier: whatever goes wrong fails this job only."""
        try:
            with owned_cancellation("the job"):
                await self._handle()
        except Exception as exc:
            await self._fail(exc)

    async def _handle(self) -> None:
        d, job = self._d, self.job
        msg = job.msg
        hop = Hop(msg, self._received_at)
        try:
            req, encoding = d.role.decode(msg.data, msg.headers)
        except RejectedJob as exc:
            self._frames = FrameSink(
                d.ctx.nc,
                exc.reply_to,
                exc.encoding,
                exc.request_id or "",
                attempt=job.attempt,
                headers=hop.header,
            )
            await self._reject(exc, exc.request_id)
            return
        batch = self._batch(msg.headers, req.reply_to, encoding)
        if not await self.serve(req, encoding, headers=hop.header, batch=batch):
            return
        frames = self._frames
        assert frames is not None
        await contained(  # the job has settled: a failing trace record is only logged
            "a trace record",
            d.traces.publish,
            hop.record(
                request_id=req.request_id,
                instance=d.ctx.instance,
                model=d.ctx.model,
                attempt=frames.attempt,
                frames=frames,
                outcome=outcome_of(frames, job.settled_how),
                prefill=self.prefill,
                queue=queue_of(d.ctx.names, msg.subject, msg.headers),
            ),
        )

    async def serve(
        self,
        req: Any,
        encoding: codec.Encoding,
        *,
        headers: dict[str, str] | None = None,
        batch: tuple[FrameBatcher, str] | None = None,
    ) -> bool:
        """Run a decoded request through its role and settle it; False when it was held back as a
        copy of one running here. Raises only what the fault barrier is for."""
        d, job = self._d, self.job
        self.request, self.request_id = req, req.request_id
        taskdump.name_task(f"job {req.request_id}")
        if req.request_id in d.running:
            # A second job with this id while the first runs here: let the first finish.
            log.warning("request %s delivered again while running here; holding the copy", req.request_id)
            d.ctx.counters.duplicates += 1
            await job.nak(delay=d.ctx.policy.ack_wait)
            return False
        frames = self._frames = FrameSink(
            d.ctx.nc,
            req.reply_to,
            encoding,
            req.request_id,
            attempt=job.attempt,
            log_subject=d.ctx.names.request_log(req.request_id),
            checkpoint_interval=(
                d.checkpoint_interval if req.reply_to is not None else d.detached_checkpoint_interval
            ),
            headers=headers,
            batch=batch,
        )
        self.tokens = frames.tokens
        await frames.pulled(d.ctx.instance, job_ack=job.msg.reply)
        await self._serve()
        return True

    async def _serve(self) -> None:
        d, job, frames, rid = self._d, self.job, self._frames, self.request_id
        assert frames is not None
        run = self._run = Running(job, frames)
        d.running[rid] = run
        try:
            with entered(run.scope):
                await d.role.run(self)
        except LogUnavailable as exc:
            log.warning("request %s waits: %s", rid, exc)
            d.ctx.counters.deferred += 1
            with anyio.CancelScope(shield=True):
                await job.nak(delay=1.0)
        except (RequestRejected, EngineRequestError) as exc:
            await self._reject(exc, rid)
        except EngineDead as exc:
            run.hand_back = True
            d.lifecycle.engine_died(str(exc))
        finally:
            d.running.pop(rid, None)
            d.ctx.counters.frames_sent += frames.frames_sent
            with anyio.CancelScope(shield=True):
                await self._settle_interrupted(run)

    def _batch(
        self, headers: dict[str, str] | None, reply_to: str | None, encoding: codec.Encoding
    ) -> tuple[FrameBatcher, str] | None:
        batcher = self._d.batcher
        subject = batch_subject(headers, reply_to, encoding) if batcher is not None else None
        return (batcher, subject) if batcher is not None and subject is not None else None

    # the handle a role runs the job through

    @property
    def attempt(self) -> int:
        return self.job.attempt

    @property
    def stage(self) -> str:
        return self.job.stage

    @stage.setter
    def stage(self, stage: str) -> None:
        self.job.stage = stage

    def hold(self) -> None:
        assert self._frames is not None
        self._frames.hold()

    def release(self) -> None:
        assert self._frames is not None
        self._frames.release()

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        self._d.tasks.start_soon(fn, *args)

    async def claim(self, *, above: int = 0, supersede: bool = False) -> None:
        d, job, frames, rid = self._d, self.job, self._frames, self.request_id
        assert frames is not None
        if above >= job.attempt:  # a broker restored from disk may count deliveries from 1 again
            job.attempt = frames.attempt = above + 1
        if supersede:
            await d.ctx.nc.publish(
                d.ctx.names.cancel(rid),
                codec.encode(CancelRequest(request_id=rid, reason="superseded", below_attempt=job.attempt)),
            )
        job.stage = "claiming it in the request log"
        await d.log.write(rid, Claim(attempt=job.attempt, worker=d.ctx.instance, at=time.time()))

    async def claim_first(self) -> bool:
        self.job.stage = "claiming it in its empty request log"
        claim = Claim(attempt=self.job.attempt, worker=self._d.ctx.instance, at=time.time())
        return await self._d.log.claim_first(self.request_id, claim)

    async def delivered(self, after: int) -> list[TokensFrame]:
        d, job, frames, rid = self._d, self.job, self._frames, self.request_id
        assert frames is not None
        if frames.reply_to is None:
            return []
        job.stage = "asking its producer what it received"
        query = ResumeQuery(request_id=rid, attempt=job.attempt, after=after)
        try:
            answer = await d.ctx.nc.request(
                frames.reply_to, codec.encode(query, frames.encoding), timeout=RESUME_QUERY_TIMEOUT
            )
            got = codec.Decoder(Delivered).decode(answer.data, frames.encoding).frames
        except nats.errors.NoRespondersError:
            return []  # nobody listens: nobody saw more than the log holds
        except Exception as exc:  # an older producer, or a stuck one: continue from the log
            log.warning(
                "request %s: its producer did not say what it received (%s); continuing from the log",
                rid,
                exc,
            )
            return []
        extra = contiguous_after(after, got)
        if extra:
            await d.log.write(rid, Steps(attempt=job.attempt, frames=extra))
        return extra

    async def accept(
        self, *, replay: Sequence[TokensFrame] = (), last_seq: int = 0, resumed_tokens: int = 0
    ) -> None:
        d, frames = self._d, self._frames
        assert frames is not None
        self.job.stage = "sending its accepted frame and earlier tokens"
        if replay:
            await frames.replay(list(replay))
        frames.seq = last_seq
        await frames.accepted(
            d.ctx.instance, d.ctx.model, job_ack=self.job.msg.reply, resumed_tokens=resumed_tokens
        )

    async def finish(
        self,
        choices: list[Choice],
        usage: Usage,
        *,
        token_ids: list[list[int]],
        text: list[str] | None = None,
        logprobs: list[ChoiceLogprobs] | None = None,
        migrations: int = 0,
    ) -> None:
        d, job, frames, rid = self._d, self.job, self._frames, self.request_id
        assert frames is not None and self._run is not None
        final = frames.final_frame(choices, usage)
        self._run.ended = True
        job.stage = "storing its result"
        await d.log.store_result(
            rid,
            Result(
                attempt=job.attempt,
                final=final,
                token_ids=token_ids,
                text=text,
                logprobs=logprobs,
                worker=d.ctx.instance,
                migrations=migrations,
            ),
        )
        # Counted once the result is stored and before the final frame: a producer that saw the
        # frame and then reads the worker's status finds the request counted.
        d.ctx.counters.completed += 1
        job.stage = "sending its final frame"
        await frames.send(final)
        await job.ack()
        d.ctx.counters.acked += 1

    async def reply(self, message: msgspec.Struct, kind: str) -> None:
        """Answer a job whose requester waits for one message and keeps no log (a prefill), and ack."""
        d, frames = self._d, self._frames
        assert frames is not None and self._run is not None
        self._run.ended = True
        self.job.stage = f"sending its {kind} answer"
        await frames.answer(message, kind)
        d.ctx.counters.completed += 1  # before the ack's round trip, as in finish()
        await self.job.ack()
        d.ctx.counters.acked += 1

    async def answer_from(self, result: Result) -> None:
        """The request already finished (a redelivery or a resubmission): answer from its result."""
        d, frames = self._d, self._frames
        assert frames is not None
        self.job.stage = "answering from its stored result"
        log.info("request %s already finished; answering from its stored result", self.request_id)
        await frames.replay_result(result, d.ctx.instance, d.ctx.model, job_ack=self.job.msg.reply)
        await self.job.ack()
        d.ctx.counters.acked += 1

    async def defer(self, delay: float) -> None:
        self._d.ctx.counters.deferred += 1
        await self.job.nak(delay=delay)

    def cancelled(self, reason: str) -> None:
        assert self._run is not None
        self._run.cancel_reason = reason

    # settling

    async def _settle_interrupted(self, run: Running) -> None:
        d, job, rid = self._d, self.job, self.request_id
        counters = d.ctx.counters
        if job.settled or run.superseded:
            if run.superseded:
                counters.superseded += 1  # the job belongs to a newer delivery now
            return
        # Counted before the awaits below: a status reader never sees the request gone but uncounted.
        if run.hand_back:
            counters.handed_back += 1
            await d.pulls.stopped()
            if not d.lifecycle.engine_dead:  # a planned move; an engine death counts against the budget
                try:
                    await run.frames.checkpoint(time.monotonic())
                    await d.log.write(rid, Handoff(attempt=job.attempt, reason="worker draining"))
                except Exception:  # the next worker then counts a death against the budget; still moves
                    log.exception("request %s: hand-off not recorded", rid)
            await job.nak()
        elif run.cancel_reason is not None:
            counters.cancelled += 1
            err = run.frames.error_frame(ErrorCode.CANCELLED, run.cancel_reason)
            try:
                await d.log.store_result(rid, Result(attempt=job.attempt, error=err, worker=d.ctx.instance))
            except Exception:  # a resubmission may then run again; the producer still hears it ended
                log.exception("request %s: cancelled result not stored", rid)
            await run.frames.send(err)
            await job.term()

    async def _reject(self, exc: JetllmError, request_id: str | None, code: ErrorCode | None = None) -> None:
        """Error frame to the producer, the job to the dead-letter stream, then terminate it.

        Never raises: a step that fails is logged and the rest still happens, and a job that
        cannot be dead-lettered is handed back rather than lost.
        """
        d, job, frames = self._d, self.job, self._frames
        assert frames is not None
        code = code or exc.code
        d.ctx.errors[code.value] += 1
        which = request_id or f"seq {job.stream_seq}"
        log.info("request %s rejected: %s: %s", which, code.value, exc.message)
        with anyio.CancelScope(shield=True):
            err = frames.error_frame(code, exc.message, field=exc.field)
            if request_id:
                try:
                    await d.log.store_result(
                        request_id, Result(attempt=job.attempt, error=err, worker=d.ctx.instance)
                    )
                except Exception as exc2:  # a resubmission may run again; the producer still hears why
                    log.warning("request %s: error result not stored: %s", request_id, exc2)
            await frames.send(err)
            try:
                subject, payload, headers, part = self._letter()
                record = dead_letter_record(
                    subject=subject,
                    payload=payload,
                    headers=headers,
                    code=code,
                    reason=exc.message,
                    worker=d.ctx.instance,
                    deliveries=job.attempt,
                    request_id=request_id,
                    max_payload=d.ctx.nc.max_payload,
                )
                await d.dead_letters.publish(record, job.stream_seq, part=part)
            except Exception as exc2:  # keep the job rather than lose it
                log.error("dead-lettering seq %d failed (%s); handing it back", job.stream_seq, exc2)
                await job.nak(delay=d.ctx.policy.ack_wait)
                return
            d.ctx.counters.dead_lettered += 1
            await job.term()

    async def refuse(self, exc: JetllmError, request_id: str | None = None) -> None:
        """Fail the delivery with `exc` before its role saw it (an error result for `request_id`,
        the error frame, the dead letter, the term): for what the runtime itself cannot run."""
        if self._frames is None:
            self._frames = FrameSink(
                self._d.ctx.nc, None, "msgpack", request_id or "", attempt=self.job.attempt
            )
        await self._reject(exc, request_id)

    def _letter(self) -> tuple[str, bytes, dict[str, str] | None, str | None]:
        """What this delivery's dead letter holds (its subject, payload and headers, as a replay
        publishes them), and what tells it from the others of the same stream message (None: there
        are none; a shard's requests each have one)."""
        msg = self.job.msg
        return msg.subject, msg.data, msg.headers, None

    async def _fail(self, exc: Exception) -> None:
        """The fault barrier: an unexpected exception while handling one job fails that job only.

        The producer gets one `internal` error frame saying what failed (none if it already had
        its terminal frame), the job goes to the dead-letter stream with the exception's type, the
        traceback is logged once, and the worker serves the next job.
        """
        job = self.job
        request_id = self.request_id or None
        what = f"jetllm failed while {job.stage}: {type(exc).__name__}: {exc}"[:2000]
        which = request_id or f"seq {job.stream_seq}"
        log.error("request %s: %s", which, what, exc_info=exc)
        if job.settled:
            return
        try:
            if self._frames is None:
                request_id, reply_to, encoding = salvage(job.msg.data, job.msg.headers)
                self._frames = FrameSink(
                    self._d.ctx.nc, reply_to, encoding, request_id or "", attempt=job.attempt
                )
            await self._reject(RequestRejected(ErrorCode.INTERNAL, what), request_id)
        except Exception:  # nothing more can be done here; JetStream redelivers after ack_wait
            log.exception("request %s: the failed job could not be settled", which)


def intake(deps: JobDeps, slots: Slots) -> Callable[[Msg], None]:
    """What a puller calls with each job it got: a slot is taken at once (the pullers' shared
    count), and the job runs in the jobs' group until it is settled."""
    counters = deps.ctx.counters

    async def run_job(msg: Msg, received_at: float) -> None:
        try:
            await JobRun(deps, msg, received_at=received_at).run()
        except Exception:  # the barrier inside run() failed too; JetStream redelivers after ack_wait
            log.exception("a job could not be handled or failed")
        finally:
            slots.release()

    def on_job(msg: Msg) -> None:
        slots.take()
        counters.pulled += 1
        deps.tasks.start_soon(run_job, msg, time.time())

    return on_job
