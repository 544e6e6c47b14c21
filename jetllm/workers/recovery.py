"""Putting back the request-log records the servers may have dropped: after a reconnect, and after
the request log's stream got a new leader.

Token frames are logged with plain publishes for speed; while a restarted server is still loading
its streams those are dropped, and so are those sent to a cluster while the stream has no leader
(the seconds of an election after its leader died), with no reconnect of the worker to tell. A
later attempt would then regenerate tokens the producer already has, and a producer that lost
frames in the same failover could not read them back. Each running request keeps its own token
frames (`FrameSink.logged`) so they can be rewritten.
"""

from __future__ import annotations

import logging
import time

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..schemas import Claim, Steps
from .requestlog import LogUnavailable, RequestLog
from .running import Running, RunningRequests

log = logging.getLogger(__name__)

PASSES = (0.0, 2.0, 5.0)
"""Seconds after a reconnect or an election is noticed at which every running request's log is checked.
One pass is not enough: the advisory can come before the new leader takes publishes (its interest
reaches the other servers after it), and records dropped in that gap are only seen by a later pass."""


def due_passes(now: float, changed: bool, due: list[float]) -> tuple[bool, list[float]]:
    """Whether a pass runs now, and the passes still due after it; a change schedules `PASSES`
    afresh (the passes of an earlier change are covered by them)."""
    if changed:
        due = [now + d for d in PASSES]
    if due and due[0] <= now:
        return True, [t for t in due if t > now]
    return False, due


async def resync_after_reconnects(
    nc: NATS, request_log: RequestLog, instance: str, running: RunningRequests
) -> None:
    seen = nc.stats["reconnects"]
    elections = 0
    handled = 0
    due: list[float] = []

    async def on_election(msg: Msg) -> None:
        nonlocal elections
        elections += 1

    sub = await nc.subscribe(request_log.names.requests_leader_advisory, cb=on_election)
    try:
        while True:
            await anyio.sleep(0.5)
            if not nc.is_connected:
                continue
            changed = nc.stats["reconnects"] != seen or elections != handled
            seen, handled = nc.stats["reconnects"], elections
            run_now, due = due_passes(time.monotonic(), changed, due)
            if not run_now:
                continue
            for rid, run in list(running.items()):
                await _resync_retried(request_log, instance, rid, run)
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is closing anyway
                pass


async def _resync_retried(request_log: RequestLog, instance: str, rid: str, run: Running) -> None:
    for delay in (0.5, 1, 2, 4, 8, None):
        try:
            await resync(request_log, instance, rid, run)
            return
        except LogUnavailable as exc:
            if delay is None:
                log.warning("request %s: log not resynchronised: %s", rid, exc)
            else:
                await anyio.sleep(delay)


async def resync(request_log: RequestLog, instance: str, rid: str, run: Running) -> None:
    frames = run.frames
    if frames.log_subject is None or run.job.settled or run.ended:
        return
    history = await request_log.history(rid)
    if history.last_attempt > run.job.attempt or history.result is not None or run.ended:
        return  # superseded (the newer attempt owns the log), or ended meanwhile
    stored = {f.seq for f in history.frames}
    missing = [f for f in list(frames.logged) if f.seq not in stored]
    if history.last_attempt < run.job.attempt:
        await request_log.write_stored(rid, Claim(attempt=run.job.attempt, worker=instance, at=time.time()))
    if missing and not run.ended:
        await request_log.write_stored(rid, Steps(attempt=run.job.attempt, frames=missing))
    if missing:
        log.info("request %s: rewrote %d token records the server lost", rid, len(missing))
