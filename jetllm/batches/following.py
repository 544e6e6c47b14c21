"""Following a batch's lines from their submission to their results. A line's result is seen live
on its request log's subject, subscribed to before its job is published (no consumer on the
server per line), and read directly only when it may have gone by unseen (`plan.read_result`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from nats.aio.msg import Msg
from nats.js.api import PubAck

from ..aio import task_group
from ..errors import JetllmError
from ..openai.errors import OpenAIError
from ..producer import Client
from ..schemas import Claim, ErrorCode, ErrorFrame, Record, Result
from ..subjects import codec
from ..subjects.names import Names
from . import plan
from .lines import InputLine, line_request_id

log = logging.getLogger(__name__)
_record_decoder = codec.KindDecoder(Record)

RESULT_CHECK = 5.0
"""Seconds between a running line's looks at whether to read its result directly (`plan.read_result`)."""

Submit = Callable[[], Awaitable[PubAck]]
"""Publishes what carries the lines followed together: a line's job, or the shard of them all."""


class LineFollower:
    """Follows lines of one batch; it gets the client, the names and two callbacks, never the batch.
    `on_claim(line)`: a worker took the line's job. `on_end(line, result, submitted)`: the line's
    result, and whether this runner's submission of it was published."""

    def __init__(
        self,
        client: Client,
        names: Names,
        batch_id: str,
        *,
        on_claim: Callable[[int], None],
        on_end: Callable[[int, Result, bool], None],
    ) -> None:
        self.client = client
        self.names = names
        self.batch_id = batch_id
        self.on_claim = on_claim
        self.on_end = on_end

    async def follow(
        self, lines: list[InputLine], submit: Submit, done: Callable[[], None] | None = None
    ) -> None:
        """Follow `lines`, submitted by one `submit` (a shard's lines share its one publish), each
        until its result is in its request log; every log is subscribed to before `submit` runs.
        `done` is called as soon as every line has ended (or was cancelled), before unsubscribing."""
        subs: list[Any] = []
        try:
            waits = []
            for line in lines:
                rid = line_request_id(self.batch_id, line.line)
                found: list[Result] = []
                ended = anyio.Event()
                try:
                    subs.append(
                        await self.client.nc.subscribe(
                            self.names.request_log(rid), cb=self._on_record(line.line, found, ended)
                        )
                    )
                    subscribed = True
                except Exception as exc:  # the server is away for now: the line subscribes again
                    log.info("batch %s: subscribing to %s again after %s", self.batch_id, rid, exc)
                    subscribed = False
                waits.append((line, rid, found, ended, subscribed))
            async with task_group() as tg:
                for line, rid, found, ended, subscribed in waits:
                    tg.start_soon(self._follow_line, line, rid, found, ended, subscribed, submit)
        finally:
            if done is not None:
                done()
            with anyio.CancelScope(shield=True):
                for sub in subs:
                    with contextlib.suppress(Exception):  # the connection is gone, and sub with it
                        await sub.unsubscribe()

    async def _follow_line(
        self,
        line: InputLine,
        rid: str,
        found: list[Result],
        ended: anyio.Event,
        subscribed: bool,
        submit: Submit,
    ) -> None:
        """Submit the line's job and wait for its result: a direct read only after an earlier
        runner's job (a duplicate publish), a reconnect, or once a minute. Lines submit
        concurrently, so their publish acks overlap."""
        sub = None
        submitted = duplicate = reconnected = False
        last_read, reconnects = time.monotonic(), self._reconnects()
        try:
            while not found:
                try:
                    if not subscribed and sub is None:
                        sub = await self.client.nc.subscribe(
                            self.names.request_log(rid), cb=self._on_record(line.line, found, ended)
                        )
                    if not submitted:
                        try:
                            ack = await submit()
                        except (JetllmError, OpenAIError) as exc:
                            found.append(unsubmittable(rid, exc))
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
                    log.info("batch %s: trying %s again after %s", self.batch_id, rid, exc)
                    reconnected = submitted
                with anyio.move_on_after(RESULT_CHECK):
                    await ended.wait()
                reconnected = reconnected or self._reconnects() != reconnects
        finally:
            if sub is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self.on_end(line.line, found[0], submitted)

    def _on_record(
        self, line: int, found: list[Result], ended: anyio.Event
    ) -> Callable[[Msg], Awaitable[None]]:
        """What a line's subscription does with each record of its log: a claim is reported, a
        result ends the wait."""

        async def on_record(msg: Msg) -> None:
            try:
                record = _record_decoder.decode(msg.data)
            except Exception:  # a newer kind of record, or not ours to read
                return
            if isinstance(record, Result):
                found.append(record)
                ended.set()
            elif isinstance(record, Claim):
                self.on_claim(line)

        return on_record

    def _reconnects(self) -> int:
        return int(self.client.nc.stats.get("reconnects", 0))


def unsubmittable(rid: str, exc: JetllmError | OpenAIError) -> Result:
    """The result of a line that never became a job: too big to publish, or a body that translated
    when the batch was created and no longer does (another version's runner)."""
    code = exc.code if isinstance(exc, JetllmError) else ErrorCode.INVALID_REQUEST
    return Result(attempt=0, error=ErrorFrame(seq=1, request_id=rid, code=code, message=exc.message))
