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

import anyio
from nats.js.api import PubAck

from .. import aio
from ..errors import JetllmError
from ..openai.endpoints import prepare
from ..openai.errors import OpenAIError
from ..producer import Client, registry
from ..schemas import (
    BatchIssue,
    BatchState,
    EmbedsPrompt,
    GenerateRequest,
    InstanceRecord,
    RequestCounts,
    Result,
    ShardJob,
)
from ..subjects import codec
from ..subjects.codec import HEADER_MARGIN
from . import plan, transitions
from .following import LineFollower, unsubmittable
from .lines import BadInput, InputLine, batch_group, line_request_id
from .output import output_files, output_lines
from .service import ApiError, BatchService, NotFound

log = logging.getLogger(__name__)

STATE_EVERY = 0.5
"""Seconds between reads of the batch's state (a cancel) and writes of its counts."""
SHARD_SIZES_EVERY = 30.0
"""Seconds between reads of the registry for which models take shards, and how large."""
CANCEL_WAIT = 10.0
"""Seconds a stopping batch waits for the lines it cancelled to report their end."""


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
        self.follower = LineFollower(
            client, service.names, batch_id, on_claim=self._claimed, on_end=self._ended
        )
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
            started = functools.partial(
                transitions.started, runner=self.runner, counts=self._counts(len(lines)), now=int(time.time())
            )
            await self.service.update(self.id, started)
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
        async with aio.task_group() as tg:
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
                    now_counts = self._counts(len(lines))
                    if now_counts != written:
                        await self.service.update(
                            self.id, functools.partial(transitions.counted, counts=now_counts)
                        )
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

    def _submit(
        self, tg: aio.TaskGroup, taken: list[InputLine], endpoint: str, sharded: dict[str, int]
    ) -> None:
        """Start following the lines taken for submission: each a job of its own, or, for models
        whose workers take shards, together as shards of up to `sharded[model]` lines."""
        groups: dict[str, list[tuple[InputLine, GenerateRequest]]] = {}
        for line in taken:
            rid = line_request_id(self.id, line.line)
            try:
                req = prepare(endpoint, line.body, rid).job.request
            except (JetllmError, OpenAIError) as exc:  # this line cannot be a job: it fails alone
                self._ended(line.line, unsubmittable(rid, exc), submitted=False)
                continue
            if req.model in sharded and req.adapter is None and not isinstance(req.prompt, EmbedsPrompt):
                groups.setdefault(req.model, []).append((line, req))
            else:
                tg.start_soon(self.follower.follow, [line], functools.partial(self.client.submit, req))
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
                done = functools.partial(self.shards.discard, shard.request_id)
                tg.start_soon(self.follower.follow, [line for line, _ in part], submit, done)

    def _claimed(self, line: int) -> None:
        if line in self.queued:
            self.queued.discard(line)
            self.changed.set()

    def _ended(self, line: int, result: Result, submitted: bool) -> None:
        """Submitted and its claim seen: a worker ran the line, so its slot is free now."""
        if submitted and line not in self.queued:
            self.free_at.append(time.monotonic())
        self.outcomes[line] = result
        self.in_flight.discard(line)
        self.queued.discard(line)
        self.changed.set()

    def _counts(self, total: int) -> RequestCounts:
        return transitions.counts(total, self.outcomes)

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
        issue = BatchIssue(code="invalid_input", message=message, param=param, line=line)
        change = functools.partial(transitions.failed, issue=issue, counts=final, now=int(time.time()))
        await self.service.update(self.id, change)

    async def _finalize(self, lines: list[InputLine], state: BatchState, stop: plan.Stop) -> None:
        if stop == "done":
            await self.service.update(
                self.id, functools.partial(transitions.finalizing, now=int(time.time()))
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
        final = self._counts(len(lines))
        final.failed = final.total - final.completed
        change = functools.partial(
            transitions.ended,
            stop=stop,
            output_file_id=out_id if out else None,
            error_file_id=err_id if errors else None,
            counts=final,
            now=int(time.time()),
        )
        done = await self.service.update(self.id, change)
        log.info("batch %s: %s (%d ok, %d failed)", self.id, done.status, final.completed, final.failed)


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
