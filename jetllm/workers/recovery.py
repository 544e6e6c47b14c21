"""Putting back the request-log records a recovering server may have dropped, after a reconnect.

Token frames are logged with plain publishes for speed; while a restarted server is still loading
its streams those are dropped, and a later attempt would regenerate tokens the producer already
has. Each running request keeps its own token frames (`FrameSink.logged`) so they can be rewritten.
"""

from __future__ import annotations

import logging
import time

import anyio
from nats.aio.client import Client as NATS

from ..schemas import Claim, Steps
from .requestlog import LogUnavailable, RequestLog
from .running import Running, RunningRequests

log = logging.getLogger(__name__)


async def resync_after_reconnects(
    nc: NATS, request_log: RequestLog, instance: str, running: RunningRequests
) -> None:
    seen = nc.stats["reconnects"]
    while True:
        await anyio.sleep(0.5)
        if nc.stats["reconnects"] == seen or not nc.is_connected:
            continue
        seen = nc.stats["reconnects"]
        for rid, run in list(running.items()):
            for delay in (0.5, 1, 2, 4, 8, None):
                try:
                    await resync(request_log, instance, rid, run)
                    break
                except LogUnavailable as exc:
                    if delay is None:
                        log.warning("request %s: log not resynchronised after a reconnect: %s", rid, exc)
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
