"""Is a worker's connection gone? One ping answers every request waiting on the same worker.

The server answers "no responders" at once for a subject nobody subscribes to, and it drops a
connection's subscriptions the moment the connection closes: that is the only death a producer
acts on. A ping with no answer in time is a busy worker, never a dead one (producer/sequencer.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import nats.errors
from nats.aio.client import Client as NATS

PROBE_TIMEOUT = 0.25
"""How long a ping waits: "no responders" comes back within a round trip to the server; later
than this, the worker is there and busy, and the next ping is soon anyway."""
PROBE_SHARED = 0.05
"""A ping sent this recently (or still out) answers for every request on the same worker: many
quiet requests on one busy worker cost it one ping, not one each."""
KEPT = 64
"""Workers whose last ping is remembered; workers come and go, the recent ones are kept."""


class _Probe:
    __slots__ = ("sent", "done", "gone")

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.done = anyio.Event()
        self.gone = False


class Pings:
    """Pings of workers' instance subjects, shared by the requests that wait on them."""

    def __init__(self, nc: NATS, subject: Callable[[str], str], start_soon: Callable[..., object]) -> None:
        """`subject`: a worker's ping subject; `start_soon`: runs a ping in a task the client owns,
        so a waiter's cancel is not the ping's end."""
        self._nc = nc
        self._subject = subject
        self._start_soon = start_soon
        self._probes: dict[str, _Probe] = {}

    async def gone(self, worker: str) -> bool:
        now = time.monotonic()
        probe = self._probes.get(worker)
        if probe is None or (probe.done.is_set() and now - probe.sent > PROBE_SHARED):
            if len(self._probes) > KEPT:
                self._probes = {w: p for w, p in self._probes.items() if now - p.sent <= PROBE_SHARED}
            probe = self._probes[worker] = _Probe(now)
            self._start_soon(self._ping, worker, probe)
        await probe.done.wait()
        return probe.gone

    async def _ping(self, worker: str, probe: _Probe) -> None:
        try:
            await self._nc.request(self._subject(worker), b"", timeout=PROBE_TIMEOUT)
        except nats.errors.NoRespondersError:
            probe.gone = True
        except Exception:
            pass
        finally:
            probe.done.set()
