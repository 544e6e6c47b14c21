"""Shard jobs: the requests of a batch's lines, many to one delivery (schemas/shard.py).

Each request of a shard runs as a job of its own would, through the same protocol and the same
role (`LineRun` is a `JobRun` whose delivery it shares with the shard's other requests), so a line
gets the log's history, the migration budget, cancels, structured outputs and adapters alike. What
it no longer costs the plane is what a delivery of its own cost: the job's own messages and
acknowledgements, a pulled frame, a trace record and, on the first delivery of a fresh shard, the
two log reads (its claim is a conditional write that fails on a log that is not empty, and only
then is the log read). Its claim and its stored result stay, so every reader of its log sees what
it always saw.

The shard settles once, when every request has ended: acked when each finished, failed, was
cancelled or was answered from its log; handed back when any must run elsewhere (a drain, a dead
engine, a log out of reach), and then only the requests without a result run again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import msgspec
from nats.aio.msg import Msg

from .. import aio, taskdump
from ..errors import RequestRejected
from ..schemas import MAX_SHARD_REQUESTS, ErrorCode, ErrorFrame, GenerateRequest, Result, ShardJob
from ..subjects import codec
from .context import WorkerContext
from .frames import FrameSink
from .jobs import Job, RejectedJob, decode_request
from .protocol import JobDeps, JobRun
from .requestlog import LogUnavailable, RequestLog
from .running import runs_it
from .slots import Slots

log = logging.getLogger(__name__)

_shard_decoder = codec.Decoder(ShardJob)


def shard_room(slots: int) -> int:
    """The most requests a worker wants in one shard, which is also the most it holds beyond its
    slots (it takes no shard while it holds one's requests beyond its slots; those wait in the
    engine's queue): a quarter of its slots, at most 64. 0 (no shards) below 8 slots."""
    room = min(64, slots // 4)
    return room if room > 1 else 0


class LineJob(Job):
    """One request's share of its shard's delivery. Settling it records how the request ended; the
    shard settles the delivery once all of its requests have."""

    def __init__(self, shard: Job) -> None:  # noqa: D107 -- no super(): the message is the shard's
        self.shard = shard
        self.msg = shard.msg
        self.attempt = shard.attempt
        self.stream_seq = shard.stream_seq
        self.subject = shard.subject
        self.settled = False
        self.settled_how: str | None = None
        self.stage = "decoding it"
        self.last_progress = shard.last_progress
        self.delay: float | None = None
        """A hand-back's delay."""

    async def in_progress(self) -> None:
        """Once for all the shard's requests: the first that asks tells the server."""
        if self.shard.last_progress <= self.last_progress:
            await self.shard.in_progress()
        self.last_progress = self.shard.last_progress

    async def _settle(self, how: str, payload: bytes) -> None:
        if not self.settled:
            self.settled, self.settled_how = True, how

    async def nak(self, delay: float | None = None) -> None:
        self.delay = delay
        await self._settle("nak", b"")


class LineRun(JobRun):
    """One request of a shard through the job protocol."""

    __slots__ = ("_encoding", "_fresh")

    def __init__(
        self, deps: JobDeps, shard: Job, req: GenerateRequest, encoding: codec.Encoding, fresh: bool
    ) -> None:
        super().__init__(deps, shard.msg, LineJob(shard))
        self.request, self.request_id = req, req.request_id
        self._frames = FrameSink(deps.ctx.nc, None, encoding, req.request_id, attempt=shard.attempt)
        self._encoding = encoding
        self._fresh = fresh

    @property
    def fresh(self) -> bool:
        """The submitter vouched that no request of the shard ran before, and this is its first
        delivery: the role need not read the log (or a durable cancel) to know the request is new."""
        return self._fresh

    async def run(self) -> None:
        try:
            with aio.owned_cancellation("the line"):
                await self.serve(self.request, self._encoding)
        except Exception as exc:
            await self._fail(exc)

    def _letter(self) -> tuple[str, bytes, dict[str, str] | None, str | None]:
        """A line's dead letter holds it as a job of its own, so a replay runs it as one."""
        names, model = self._d.ctx.names, self._d.ctx.model
        headers = {codec.CONTENT_TYPE: codec.content_type("msgpack")}
        return names.jobs("generate", model), codec.encode(self.request), headers, self.request_id

    async def refuse_line(self, field: str, message: str) -> None:
        """This request cannot be a line of its shard: it fails alone, dead-lettered as a job is."""
        await self.refuse(RequestRejected(ErrorCode.INVALID_REQUEST, message, field=field), self.request_id)


class ShardRun:
    """One delivery of a shard, from its bytes to its settlement."""

    def __init__(self, deps: JobDeps, msg: Msg, slots: Slots, held: int) -> None:
        """`held`: the slots taken for it on delivery (`shard_intake`), set to its requests' count."""
        self._d = deps
        self._msg = msg
        self._slots = slots
        self._held = held

    async def run(self) -> None:
        try:
            with aio.owned_cancellation("the shard"):
                await self._run()
        except Exception:
            log.exception("a shard could not be run; handing it back")
            with anyio.CancelScope(shield=True):
                try:
                    await Job(self._msg).nak(delay=1.0)
                except Exception:  # JetStream redelivers it after ack_wait
                    pass
        finally:
            self._hold(0)

    async def _run(self) -> None:
        d = self._d
        job = self.job = Job(self._msg)
        taskdump.name_task(f"shard seq {job.stream_seq}")
        try:
            shard, encoding = decode_request(job.msg.data, job.msg.headers, _shard_decoder)
            if shard.model != d.ctx.model:
                raise RejectedJob(
                    ErrorCode.MODEL_NOT_SERVED,
                    f"this worker serves {d.ctx.model!r}, not {shard.model!r}",
                    field="$.model",
                    request_id=shard.request_id,
                    encoding=encoding,
                )
        except RejectedJob as exc:
            await self._reject(exc)
            return
        fresh = shard.fresh and job.attempt == 1 and not await self._cancelled(shard)
        lines = [LineRun(d, job, req, encoding, fresh) for req in _once(shard)]
        self._hold(len(lines))
        refused = []
        async with aio.task_group() as tg:
            for i, line in enumerate(lines):
                problem = _line_problem(line.request, shard.model)
                if problem is None:
                    tg.start_soon(self._run_line, line)
                else:
                    refused.append((line, f"$.requests[{i}].{problem[0]}", problem[1]))
            await aio.each(refused, self._refuse)
        await self._settle([line.job for line in lines])

    async def _cancelled(self, shard: ShardJob) -> bool:
        """Whether its submitter cancelled the shard as a whole, or the group it belongs to (a
        batch stopped while the shard waited, perhaps by a runner that took the batch over): then
        each request reads its own durable cancel, as a job of its own does."""
        try:
            for rid in (shard.request_id, *((shard.group,) if shard.group else ())):
                if await self._d.log.cancel(rid) is not None:
                    return True
        except LogUnavailable:
            return True  # unknown: the requests read what they need themselves
        return False

    async def _refuse(self, refused: tuple[LineRun, str, str]) -> None:
        line, field, message = refused
        try:
            await line.refuse_line(field, message)
        finally:
            self._hold(self._held - 1)

    def _hold(self, n: int) -> None:
        """Hold `n` slots for the shard (its requests still running), taking or freeing the difference."""
        if n > self._held:
            self._slots.take(n - self._held)
        elif n < self._held:
            self._slots.release(self._held - n)
        self._held = n

    async def _run_line(self, line: LineRun) -> None:
        try:
            await line.run()
        finally:
            self._hold(self._held - 1)

    async def _settle(self, lines: list[Job]) -> None:
        if any(not line.settled for line in lines):
            # Superseded: a newer delivery of this shard runs that request; it settles the message,
            # and an ack here would leave that request to nobody if its worker died.
            log.info(
                "shard seq %d: a newer delivery runs part of it; leaving it to that one", self.job.stream_seq
            )
            return
        handed = [line for line in lines if line.settled_how == "nak"]
        if not handed:
            await self.job.ack()
            return
        delays = [getattr(line, "delay", None) for line in handed]
        delay = None if None in delays else max(d for d in delays if d is not None)
        log.info(
            "shard seq %d: %d of %d requests go back to the queue",
            self.job.stream_seq,
            len(handed),
            len(lines),
        )
        await self.job.nak(delay=delay)

    async def _reject(self, exc: RejectedJob) -> None:
        """A shard that cannot run at all: each request it names fails with the reason (whoever
        submitted them waits for their results), and the shard is dead-lettered and terminated."""
        d, job = self._d, self.job
        err = ErrorFrame(seq=1, request_id=None, code=exc.code, message=exc.message, field=exc.field)
        if await fail_requests(d.ctx, d.log, job.msg.data, exc.encoding, err, job.attempt):
            await job.nak(delay=d.ctx.policy.ack_wait)  # some could not be told: try again later
            return
        await JobRun(d, job.msg, job).refuse(exc)


FAIL_TRIES = 3
"""Passes `fail_requests` makes over the requests whose logs it could not read, a second apart."""


async def fail_requests(
    ctx: WorkerContext,
    request_log: RequestLog,
    data: bytes,
    encoding: codec.Encoding,
    err: ErrorFrame,
    attempt: int,
) -> list[str]:
    """End every request a shard names (as far as its bytes say) with `err`, unless it ended
    already or a live worker still runs it (a copy of it in another job: that one ends it):
    whoever submitted them waits for their results. For a shard that cannot run, or that JetStream
    gave up on. Each id once however often named, 32 at a time, at most a shard's worth; returns
    the ids it could not settle (their logs out of reach)."""
    todo = codec.shard_request_ids(data, encoding, MAX_SHARD_REQUESTS)
    unread: list[str] = []

    async def fail(rid: str) -> None:
        try:
            last = await request_log.last(rid)
            if isinstance(last, Result):
                return
            if last is not None:
                owner = (await request_log.history(rid)).owner
                if owner is not None and await runs_it(ctx.nc, ctx.names, owner, rid):
                    return
        except LogUnavailable:
            unread.append(rid)
            return
        ended = msgspec.structs.replace(err, request_id=rid)
        await request_log.store_result(rid, Result(attempt=attempt, error=ended, worker=ctx.instance))

    for attempt_no in range(FAIL_TRIES):
        unread = []
        await aio.each(todo, fail)
        todo = unread
        if not todo:
            break
        if attempt_no + 1 < FAIL_TRIES:
            await anyio.sleep(1.0)
    if todo:
        log.error(
            "requests %s of a shard could not be ended: their logs are out of reach", ", ".join(todo[:10])
        )
    return todo


def _once(shard: ShardJob) -> list[GenerateRequest]:
    """The shard's requests, each id once (a request named twice runs once)."""
    seen: set[str] = set()
    out = []
    for req in shard.requests:
        if req.request_id in seen:
            log.warning("shard %s names request %s twice; it runs once", shard.request_id, req.request_id)
            continue
        seen.add(req.request_id)
        out.append(req)
    return out


def _line_problem(req: GenerateRequest, model: str) -> tuple[str, str] | None:
    """(field, message) when a request cannot be a line of a shard of `model`."""
    if req.model != model:
        return "model", f"a shard's requests name its model {model!r}, not {req.model!r}"
    if req.reply_to is not None:
        return (
            "reply_to",
            "a shard's requests are detached: leave reply_to unset (their results are in the log)",
        )
    return None


def announced(headers: dict[str, str] | None) -> int:
    """The slots to hold for a shard on arrival: its announced request count, within 1..MAX."""
    try:
        n = int((headers or {}).get(codec.SHARD_REQUESTS_HEADER, "1"))
    except ValueError:
        n = 1
    return min(max(n, 1), MAX_SHARD_REQUESTS)


def shard_intake(deps: JobDeps, slots: Slots) -> Callable[[Msg], None]:
    """What the shard puller calls with each shard: the slots its requests need are held at once
    (as far as its header says; corrected once it is decoded)."""

    def on_shard(msg: Msg) -> None:
        held = announced(msg.headers)
        slots.take(held)
        deps.ctx.counters.pulled += 1
        deps.tasks.start_soon(ShardRun(deps, msg, slots, held).run)

    return on_shard
