"""One batch held by a runner, from its take to its end: its lines become detached generate jobs,
paced by `plan.Pacing`, and its results, counts and output files are kept in NATS (the batch's
state, the request log, the object store), so another runner can take over at any point."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.msg import Msg
from nats.js.api import PubAck

from .. import aio
from ..errors import JetllmError
from ..openai.endpoints import prepare
from ..openai.errors import OpenAIError
from ..producer import Client, registry
from ..schemas import (
    BatchIssue,
    BatchState,
    Claim,
    EmbedsPrompt,
    ErrorCode,
    ErrorFrame,
    GenerateRequest,
    InstanceRecord,
    Record,
    RequestCounts,
    Result,
    ShardJob,
)
from ..subjects import codec
from ..subjects.codec import HEADER_MARGIN
from . import plan
from .lines import BadInput, InputLine, batch_group, line_request_id
from .output import output_files, output_lines
from .service import ApiError, BatchService, NotFound

log = logging.getLogger(__name__)
_record_decoder = codec.KindDecoder(Record)

STATE_EVERY = 0.5
"""Seconds between reads of the batch's state (a cancel) and writes of its counts."""
RESULT_CHECK = 5.0
"""Seconds between a running line's looks at whether to read its result directly (`plan.read_result`)."""
SHARD_SIZES_EVERY = 30.0
"""Seconds between reads of the registry for which models take shards, and how large."""
CANCEL_WAIT = 10.0
"""Seconds a stopping batch waits for the lines it cancelled to report their end."""


def counts(total: int, outcomes: dict[int, Result]) -> RequestCounts:
    ok = sum(1 for r in outcomes.values() if r.final is not None)
    return RequestCounts(total=total, completed=ok, failed=len(outcomes) - ok)


class HeldBatch:
    """One batch taken by a runner; it gets only what it uses (the client, the batch service, the
    pacing and the runner's name), never the runner."""

    def __init__(
        self, client: Client, service: BatchService, pacing: plan.Pacing, runner: str, batch_id: str
    ) -> None:
        self.client = client
        self.service = service
        self.pacing = pacing
        self.runner = runner
        """The holding runner's name, kept in the batch's state."""
        self.id = batch_id
        self.outcomes: dict[int, Result] = {}
        self.in_flight: set[int] = set()
        self.queued: set[int] = set()
        """Lines submitted whose claim (a worker took the job) has not been seen. A job whose worker
        died is queued again unseen; it counts as running until it ends."""
        self.free_at: deque[float] = deque()
        """When a slot was seen free that no job of the batch was submitted for yet: a line a worker
        had claimed ended, or the registry said so as the batch started (REFILL_SECONDS)."""
        self.shards: set[str] = set()
        """Shards of this batch submitted and not yet ended: cancelled as wholes when the batch stops."""
        self.changed = anyio.Event()
        self.resumed = False
        """The batch was in progress when taken: an earlier runner may have left jobs queued or
        running that this one never submitted."""

    async def run(self) -> None:
        try:
            state = await self.service.get(self.id)
        except ApiError:
            log.warning("batch %s has no state (deleted?); dropping it", self.id)
            return
        action = plan.on_take(state.status, time.time(), state.expires_at)
        if action == "skip":
            return
        taken = time.monotonic()
        self.resumed = state.in_progress_at is not None  # no line is submitted before in progress
        try:
            lines = await self.service.input_lines(state.input_file_id, state.endpoint, bounded=False)
        except NotFound as exc:
            await (self._input_gone(state) if self.resumed else self._fail(exc.message, None, exc.param))
            return
        except (BadInput, ApiError) as exc:
            await self._fail(exc.message, getattr(exc, "line", None), exc.param)
            return
        if self.resumed:
            await self._read_finished(lines)
        read = time.monotonic()
        stop: plan.Stop
        if action == "run":
            await self.service.update(self.id, self._started(len(lines)))
            stop = await self._run_lines(lines, state.endpoint)
        else:
            stop = action
            await self._stop_in_flight(lines, wait=False)
        ran = time.monotonic()
        await self._finalize(lines, state, stop)
        log.info(
            "batch %s: %d lines read in %.0f ms, run in %.2f s, output written in %.0f ms",
            self.id,
            len(lines),
            (read - taken) * 1000,
            ran - read,
            (time.monotonic() - ran) * 1000,
        )

    def _started(self, total: int):  # noqa: ANN202
        now = int(time.time())

        def change(state: BatchState) -> BatchState | None:
            if state.status not in ("validating", "in_progress"):
                return None
            return msgspec.structs.replace(
                state,
                status="in_progress",
                in_progress_at=state.in_progress_at or now,
                runner=self.runner,
                request_counts=counts(total, self.outcomes),
            )

        return change

    async def _read_finished(self, lines: list[InputLine], *, ended_only: bool = False) -> None:
        """Results of lines an earlier runner saw finish: read, never run again. `ended_only`:
        only those that completed (a line cancelled as the batch stops is the batch's, not its own
        failure)."""

        async def read(line: InputLine) -> None:
            found = await self.client.result(line_request_id(self.id, line.line))
            if found is not None and (found.final is not None or not ended_only):
                self.outcomes[line.line] = found

        await aio.each(lines, read)
        if self.outcomes:
            log.info("batch %s: %d of %d lines had finished already", self.id, len(self.outcomes), len(lines))

    async def _run_lines(self, lines: list[InputLine], endpoint: str) -> plan.Stop:
        pending = deque(line for line in lines if line.line not in self.outcomes)
        records = await self._registry()
        # capped: a registry record is not trusted to state a sane number of slots
        free = 0 if self.pacing.refill <= 0 else plan.free_slots(records, {m for m in _models(lines)})
        self.free_at.extend([time.monotonic()] * min(free, len(pending)))
        sharded = plan.shard_sizes(records, self.pacing.shard)
        sizes_read = time.monotonic()
        last_state = 0.0
        written = None
        async with anyio.create_task_group() as tg:
            while pending or self.in_flight:
                self.changed = anyio.Event()  # before the awaits below: a line ending meanwhile sets it
                now = time.monotonic()
                if now - last_state >= STATE_EVERY:
                    last_state = now
                    state = await self.service.get(self.id)
                    stop = plan.stop_reason(state.status, time.time(), state.expires_at)
                    if stop is not None:
                        await self._stop_in_flight(lines)
                        tg.cancel_scope.cancel()
                        return stop
                    now_counts = counts(len(lines), self.outcomes)
                    if now_counts != written:
                        await self.service.update(self.id, _with_counts(now_counts))
                        written = now_counts
                r = self.pacing
                while self.free_at and self.free_at[0] < now - r.refill:
                    self.free_at.popleft()
                n = plan.to_submit(
                    len(pending), len(self.queued), len(self.in_flight), r.window, r.most, len(self.free_at)
                )
                for _ in range(plan.widened_by(len(self.queued), n, r.window)):
                    self.free_at.popleft()  # that slot is spoken for
                if n and now - sizes_read >= SHARD_SIZES_EVERY:  # workers come and go, of other versions too
                    sizes_read = now
                    sharded = plan.shard_sizes(await self._registry(), self.pacing.shard)
                taken = [pending.popleft() for _ in range(n)]
                for line in taken:
                    self.in_flight.add(line.line)
                    self.queued.add(line.line)
                self._submit(tg, taken, endpoint, sharded)
                with anyio.move_on_after(STATE_EVERY):
                    await self.changed.wait()
        return "done"

    async def _registry(self) -> list[InstanceRecord]:
        """The live instances, by the registry: the first round fills their free slots at once
        rather than `window` jobs per claim (what it leaves unused lapses), and the models whose
        workers take shards get their lines as shards."""
        try:
            return await registry.instances(self.client.js, self.service.names)
        except Exception as exc:  # the window alone then paces the first round, lines go one by one
            log.info("batch %s: the registry did not say which slots are free (%s)", self.id, exc)
            return []

    def _submit(self, tg: TaskGroup, taken: list[InputLine], endpoint: str, sharded: dict[str, int]) -> None:
        """Start following the lines taken for submission: each a job of its own, or, for models
        whose workers take shards, together as shards of up to `sharded[model]` lines."""
        groups: dict[str, list[tuple[InputLine, GenerateRequest]]] = {}
        for line in taken:
            rid = line_request_id(self.id, line.line)
            try:
                req = prepare(endpoint, line.body, rid).job.request
            except (JetllmError, OpenAIError) as exc:  # this line cannot be a job: it fails alone
                self._ended(line.line, _failed(rid, exc), ran=False)
                continue
            if req.model in sharded and req.adapter is None and not isinstance(req.prompt, EmbedsPrompt):
                groups.setdefault(req.model, []).append((line, req))
            else:
                tg.start_soon(self._run_lines_as, [line], functools.partial(self.client.submit, req))
        limit = (self.client.nc.max_payload - HEADER_MARGIN) // 2
        for model, members in groups.items():
            for part in plan.shards(members, sharded[model], limit, lambda m: len(codec.encode(m[1]))):
                shard = ShardJob(
                    request_id=f"{batch_group(self.id)}-shard-{uuid.uuid4().hex[:12]}",
                    model=model,
                    requests=[req for _, req in part],
                    fresh=not self.resumed,
                    group=batch_group(self.id),
                )
                self.shards.add(shard.request_id)
                submit = _Once(functools.partial(self.client.submit_shard, shard))
                tg.start_soon(self._run_lines_as, [line for line, _ in part], submit, shard.request_id)

    async def _run_lines_as(
        self, lines: list[InputLine], submit: Callable[[], Awaitable[PubAck]], shard: str | None = None
    ) -> None:
        """Follow `lines`, submitted by one `submit` (a job, or the shard that carries them all),
        each until its result is in its request log; their logs are subscribed to before it runs."""
        subs: list[Any] = []
        try:
            waits = []
            for line in lines:
                rid = line_request_id(self.id, line.line)
                found: list[Result] = []
                ended = anyio.Event()
                on_record = self._on_record(line.line, found, ended)
                try:
                    subs.append(
                        await self.client.nc.subscribe(self.service.names.request_log(rid), cb=on_record)
                    )
                    subscribed = True
                except Exception as exc:  # the server is away for now: the line subscribes again
                    log.info("batch %s: subscribing to %s again after %s", self.id, rid, exc)
                    subscribed = False
                waits.append((line, rid, found, ended, subscribed))
            async with anyio.create_task_group() as tg:
                for line, rid, found, ended, subscribed in waits:
                    tg.start_soon(self._run_line, line, rid, found, ended, subscribed, submit)
        finally:
            if shard is not None:
                self.shards.discard(shard)
            with anyio.CancelScope(shield=True):
                for sub in subs:
                    try:
                        await sub.unsubscribe()
                    except Exception:
                        pass

    async def _run_line(
        self,
        line: InputLine,
        rid: str,
        found: list[Result],
        ended: anyio.Event,
        subscribed: bool,
        submit: Callable[[], Awaitable[PubAck]],
    ) -> None:
        """Submit the line's job and wait until its result is in its request log: seen live on
        the log's subject, subscribed to before the job is submitted (no consumer on the server per
        line), and read directly only when it may have gone by unseen (`plan.read_result`: an earlier
        runner's job, a reconnect, and once a minute). Lines submit concurrently, so their publish
        acks overlap."""
        sub = None
        submitted = duplicate = reconnected = False
        last_read, reconnects = time.monotonic(), self._reconnects()
        try:
            while not found:
                try:
                    if not subscribed and sub is None:
                        sub = await self.client.nc.subscribe(
                            self.service.names.request_log(rid), cb=self._on_record(line.line, found, ended)
                        )
                    if not submitted:
                        try:
                            ack = await submit()
                        except (JetllmError, OpenAIError) as exc:
                            found.append(_failed(rid, exc))  # this line cannot be a job: it fails alone
                            break
                        # subscribed after its shard was published: its records may have gone by
                        submitted, duplicate = True, bool(ack.duplicate) or not subscribed
                    if plan.read_result(
                        duplicate=duplicate, reconnected=reconnected, since_read=time.monotonic() - last_read
                    ):
                        duplicate = reconnected = False
                        last_read, reconnects = time.monotonic(), self._reconnects()
                        stored = await self.client.result(rid)
                        if stored is not None:
                            found.append(stored)
                            break
                except Exception as exc:  # the server is away for now: submitted or read again later
                    log.info("batch %s: trying %s again after %s", self.id, rid, exc)
                    reconnected = submitted
                with anyio.move_on_after(RESULT_CHECK):
                    await ended.wait()
                reconnected = reconnected or self._reconnects() != reconnects
        finally:
            if sub is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await sub.unsubscribe()
                    except Exception:
                        pass
        self._ended(line.line, found[0], ran=submitted and line.line not in self.queued)

    def _on_record(
        self, line: int, found: list[Result], ended: anyio.Event
    ) -> Callable[[Msg], Awaitable[None]]:
        """What a line's subscription does with each record of its log: a claim takes the line out
        of the window, a result ends the wait."""

        async def on_record(msg: Msg) -> None:
            try:
                record = _record_decoder.decode(msg.data)
            except Exception:  # a newer kind of record, or not ours to read
                return
            if isinstance(record, Result):
                found.append(record)
                ended.set()
            elif isinstance(record, Claim) and line in self.queued:
                self.queued.discard(line)
                self.changed.set()

        return on_record

    def _reconnects(self) -> int:
        return int(self.client.nc.stats.get("reconnects", 0))

    def _ended(self, line: int, result: Result, *, ran: bool) -> None:
        """`ran`: a worker claimed the line's job, so its slot is free now."""
        self.outcomes[line] = result
        if ran:
            self.free_at.append(time.monotonic())
        self.in_flight.discard(line)
        self.queued.discard(line)
        self.changed.set()

    async def _stop_in_flight(self, lines: list[InputLine], wait: bool = True) -> None:
        """Cancel the lines queued or running; wait a little for their ends to be recorded. In a
        resumed batch, every line without an outcome: an earlier runner's jobs are not this
        one's to follow, and those that finished meanwhile are read, not written off."""
        earlier = []
        if self.resumed:
            earlier = [x for x in lines if x.line not in self.outcomes and x.line not in self.in_flight]
        # the batch's own cancel stops the shards still queued, an earlier runner's among them
        stopped: list[int | str] = [
            batch_group(self.id),
            *self.shards,
            *self.in_flight,
            *(x.line for x in earlier),
        ]
        await aio.each(stopped, self._cancel)
        if earlier:
            await self._read_finished(earlier, ended_only=True)
        with anyio.move_on_after(CANCEL_WAIT if wait else 0):
            while self.in_flight:
                self.changed = anyio.Event()
                await self.changed.wait()

    async def _cancel(self, line: int | str) -> None:
        """Cancel a line, or a shard as a whole (its requests then read their own cancels)."""
        rid = line if isinstance(line, str) else line_request_id(self.id, line)
        try:
            await self.client.cancel(rid, reason="batch stopped")
        except Exception as exc:
            log.warning("batch %s: could not cancel %s: %s", self.id, rid, exc)

    async def _input_gone(self, state: BatchState) -> None:
        """A resumed batch whose input file is gone (deleted by other means than the API, which
        refuses it): without the custom ids no output file can be written. Its queued lines are
        cancelled rather than left to run for nobody; the lines that finished are counted and
        their results stay in the request log, by request id (`results_max_age`)."""
        total = state.request_counts.total
        numbers = range(1, total + 1)
        await self._cancel(batch_group(self.id))
        await aio.each(numbers, self._cancel)
        await self._read_finished(
            [InputLine(line=n, custom_id="", body={}) for n in numbers], ended_only=True
        )
        done = len(self.outcomes)
        message = (
            f"input file {state.input_file_id} was deleted while the batch ran, so no output file can be "
            f"written: {done} of {total} lines had completed (their results stay readable by request id "
            f"batch-<id>-<line> for the namespace's results_max_age), the rest were cancelled. Upload the "
            "file again and create a new batch"
        )
        await self._fail(
            message, None, "input_file_id", RequestCounts(total=total, completed=done, failed=total - done)
        )

    async def _fail(
        self, message: str, line: int | None, param: str | None, final: RequestCounts | None = None
    ) -> None:
        now = int(time.time())
        issue = BatchIssue(code="invalid_input", message=message, param=param, line=line)

        def change(state: BatchState) -> BatchState | None:
            if state.status in plan.TERMINAL_STATUSES:
                return None
            kept = final or state.request_counts
            return msgspec.structs.replace(
                state, status="failed", failed_at=now, errors=[issue], request_counts=kept
            )

        await self.service.update(self.id, change)

    async def _finalize(self, lines: list[InputLine], state: BatchState, stop: plan.Stop) -> None:
        if stop == "done":
            now = int(time.time())
            await self.service.update(
                self.id,
                lambda s: (
                    None
                    if s.status != "in_progress"
                    else msgspec.structs.replace(s, status="finalizing", finalizing_at=now)
                ),
            )
        out, errors = await anyio.to_thread.run_sync(
            output_lines, self.id, lines, self.outcomes, state.endpoint, stop
        )
        out_id, err_id = output_files(self.id)
        tail = self.id.removeprefix("batch_")
        if out:
            await self.service.write_output(out_id, f"batch_{tail}_output.jsonl", b"".join(out))
        if errors:
            await self.service.write_output(err_id, f"batch_{tail}_errors.jsonl", b"".join(errors))
        final = counts(len(lines), self.outcomes)
        final.failed = final.total - final.completed
        now = int(time.time())

        def change(s: BatchState) -> BatchState | None:
            if s.status in plan.TERMINAL_STATUSES:
                return None
            status = plan.FINAL_STATUS[stop] if s.status != "cancelling" else "cancelled"
            return msgspec.structs.replace(
                s,
                status=status,
                output_file_id=out_id if out else None,
                error_file_id=err_id if errors else None,
                request_counts=final,
                **{f"{status}_at": now},
            )

        done = await self.service.update(self.id, change)
        log.info("batch %s: %s (%d ok, %d failed)", self.id, done.status, final.completed, final.failed)


def _with_counts(c: RequestCounts):  # noqa: ANN202
    def change(state: BatchState) -> BatchState | None:
        if state.status != "in_progress":
            return None
        return msgspec.structs.replace(state, request_counts=c)

    return change


def _models(lines: list[InputLine]) -> set[str]:
    return {str(line.body.get("model")) for line in lines}


class _Once:
    """One publish shared by every line it carries (a shard's): the first line to ask publishes,
    the others get the same answer; a publish that failed is tried again by the next to ask."""

    def __init__(self, publish: Callable[[], Awaitable[PubAck]]) -> None:
        self._publish = publish
        self._lock = anyio.Lock()
        self._ack: PubAck | None = None

    async def __call__(self) -> PubAck:
        async with self._lock:
            if self._ack is None:
                self._ack = await self._publish()
            return self._ack


def _failed(rid: str, exc: JetllmError | OpenAIError) -> Result:
    """A line that never became a job: too big to publish, or a body that translated when the
    batch was created and no longer does (another version's runner)."""
    code = exc.code if isinstance(exc, JetllmError) else ErrorCode.INVALID_REQUEST
    return Result(attempt=0, error=ErrorFrame(seq=1, request_id=rid, code=code, message=exc.message))
