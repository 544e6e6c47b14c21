"""The requests running on this worker: what keeps them alive, and how the rest of the system
reaches them while they run.

A quiet request gets heartbeat frames (its producer would think the worker dead) and a long one
in-progress acks (JetStream would redeliver it). A producer's cancel, a newer delivery taking a
request over, and a drain all end a request the same way: they mark why and cancel its scope,
and the job path settles it by that mark. The ping is how a client, or a worker about to take a
request over, tells a dead or stalled worker from a busy one.
"""

from __future__ import annotations

import logging
import time

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..schemas import CancelRequest
from ..subjects import codec
from ..subjects.names import Names
from .frames import FrameSink
from .jobs import Job

log = logging.getLogger(__name__)


class Running:
    __slots__ = ("job", "frames", "scope", "hand_back", "cancel_reason", "superseded", "ended")

    def __init__(self, job: Job, frames: FrameSink) -> None:
        self.job = job
        self.frames = frames
        self.scope = anyio.CancelScope()
        self.hand_back = False
        self.cancel_reason: str | None = None
        self.superseded = False
        self.ended = False
        """Its result is being stored: the log must get no record after it (its rollup keeps the last)."""


class RunningRequests(dict[str, Running]):
    """By request id, not job: a cancel, a ping and a takeover all name the request."""

    def __init__(self, nc: NATS) -> None:
        super().__init__()
        self.nc = nc

    def hand_back_all(self) -> None:
        for run in self.values():
            run.hand_back = True
            run.scope.cancel()

    def hand_back_remaining(self) -> None:
        """The grace period is over: whatever still runs goes back to the queue for another worker."""
        if self:
            log.info("handing back %d running jobs", len(self))
            self.hand_back_all()

    async def tick(self, heartbeat_interval: float, ack_wait: float) -> None:
        """Heartbeat frames and due checkpoints for quiet requests, in-progress acks for long ones."""
        every = min(heartbeat_interval, ack_wait / 3) / 2
        progress_every = ack_wait / 3
        while True:
            await anyio.sleep(every)
            now = time.monotonic()
            for run in list(self.values()):
                await run.frames.checkpoint_if_due(now)  # a request that went quiet after some tokens
                await run.frames.heartbeat_if_idle(now, heartbeat_interval)
                if now - run.job.last_progress >= progress_every:
                    await run.job.in_progress()

    async def on_cancel(self, msg: Msg) -> None:
        try:
            cancel = codec.Decoder(CancelRequest).decode(msg.data, codec.encoding_of(msg.headers))
        except Exception:
            return
        run = self.get(cancel.request_id)
        if run is None or run.cancel_reason is not None or run.superseded:
            return
        if cancel.below_attempt is not None:
            if run.job.attempt < cancel.below_attempt:
                log.warning(
                    "request %s: delivery %d took it over; stopping here",
                    cancel.request_id,
                    cancel.below_attempt,
                )
                run.superseded = True
                run.scope.cancel()
            return
        log.info("request %s cancelled by its producer", cancel.request_id)
        run.cancel_reason = cancel.reason or "cancelled by the producer"
        run.scope.cancel()

    async def on_ping(self, msg: Msg) -> None:
        """Empty: "alive". With a request id: whether this worker runs it ("running" or "idle")."""
        if not msg.reply:
            return
        if not msg.data:
            await self.nc.publish(msg.reply, b"")
            return
        run = self.get(msg.data.decode(errors="replace"))
        await self.nc.publish(msg.reply, b"running" if run is not None and not run.job.settled else b"idle")


async def runs_it(nc: NATS, names: Names, worker: str, request_id: str) -> bool:
    """Asks `worker` the ping above: False unless it answers that it still runs the request."""
    try:
        reply = await nc.request(names.instance_control(worker, "ping"), request_id.encode(), timeout=1.0)
    except Exception:  # no responders (dead), or no answer in time (stalled): take it over
        return False
    return reply.data == b"running"
