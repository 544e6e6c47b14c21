"""Pulling jobs so that requested + running never exceeds the worker's slots.

nats-py's `fetch(batch=n)` waits for the whole batch (or its timeout) before returning, which
would hold the first job of a quiet queue for seconds. This puller instead sends raw pull
requests, each with its own reply token, and hands every job over the moment it arrives. The
credit of all its pull requests is tracked (`PullCredit`) until it is used, expires (408) or is
refused (409), so the worker always knows how many more jobs the server may still send it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..subjects.direct import subscribe_direct
from .pullcredit import PullCredit, Refusals
from .pullshare import must_cancel

log = logging.getLogger(__name__)


STRAY_DELAY = 0.5
"""A job that came with no slot for it goes back after this long, so it cannot bounce through
its deliveries between workers' stale credit in a moment."""


async def _nak(msg: Msg) -> None:
    try:
        await msg.nak(delay=STRAY_DELAY)
    except Exception as exc:
        log.warning("could not hand back a stray job: %s", exc)


def _pending(msg: Msg) -> int | None:
    """What a pull request still had when a status ended it (the server says so on 408, some 409s)."""
    try:
        return int(msg.headers["Nats-Pending-Messages"]) if msg.headers else None
    except (KeyError, ValueError):
        return None


class Puller:
    def __init__(
        self,
        nc: NATS,
        stream: str,
        consumer: str,
        *,
        free_slots: Callable[[], int],
        on_job: Callable[[Msg], None],
        expires: float = 3.0,
        api_prefix: str = "$JS.API",
        room: Callable[[], int] | None = None,
        keep: Callable[[], int] | None = None,
        yielding: Callable[[], bool] = lambda: False,
        on_ended: Callable[[str], None] = lambda status: None,
    ) -> None:
        """`free_slots`: the credit this puller may ask for; `keep`: the credit it may keep once
        asked (default: `free_slots`); `room`: the slots free for a job that arrives (default:
        `free_slots`); `yielding`: whether another queue waits for the slots
        this one holds credit for; `on_ended`: a status closed a pull request ("404", "408", ...)
        or the credit was dropped ("cancelled")."""
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._free_slots = free_slots
        self._room = room or free_slots
        self._keep = keep or free_slots
        self._yielding = yielding
        self._on_ended = on_ended
        self._on_job = on_job
        self._expires = expires
        self._inbox = ""
        self._credit = PullCredit()
        self._refusals = Refusals()
        self._counter = 0
        self._wake = anyio.Event()
        self._stopping = False
        self._strays: list[Msg] = []
        self.done = anyio.Event()
        """Set once no more jobs can arrive: safe to hand jobs back without them bouncing to us."""
        self.bound = False
        """True once the first pull request was answered by the consumer."""
        self.pulled = 0

    @property
    def outstanding(self) -> int:
        """Jobs the server may still send here."""
        return self._credit.total

    def wake(self) -> None:
        """Call when a slot frees up."""
        self._wake.set()

    async def run(self) -> None:
        """Pull until stop(); then drop all outstanding credit and hand back stray deliveries.

        Closing the reply inbox is what cancels outstanding pull requests: the server drops a pull
        request whose reply subject has lost its interest. The inbox is drained, not just
        unsubscribed, so a job the server sent before it saw the unsubscribe is still handled.
        """
        if self._stopping:  # stopped while it waited to start again
            self.done.set()
            return
        sub = None
        try:
            sub = await self._open_inbox()
            while not self._stopping:
                self._credit.expire(time.monotonic())
                if must_cancel(self.outstanding, self._keep(), self._yielding()) and self._nc.is_connected:
                    # Credit we cannot honour (paused, or another queue of this worker took the
                    # slots, or directed jobs wait for them): cancel it, so no job waits here for
                    # a slot until its ack_wait runs out.
                    sub = await self._reopen_inbox(sub)
                    self._on_ended("cancelled")
                await self._hand_back_strays()
                if self._stopping:
                    break
                want = self._free_slots() - self.outstanding
                pause = self._refusals.wait_left(time.monotonic())
                if want > 0 and self._nc.is_connected and pause <= 0:
                    await self._request(want)
                with anyio.move_on_after(pause if pause > 0 else self._expires / 2):
                    await self._wake.wait()
                self._wake = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True):
                if sub is not None:
                    await self._close_inbox(sub)
                self._credit.clear()
                await self._hand_back_strays()
                if self._stopping:  # else it starts again (supervised): not done
                    self.done.set()

    async def _open_inbox(self) -> Subscription:
        inbox = self._nc.new_inbox()  # under the identity's inbox prefix
        sub = await subscribe_direct(self._nc, f"{inbox}.*", self._on_msg)
        self._inbox = inbox
        return sub

    async def _reopen_inbox(self, old: Subscription) -> Subscription:
        try:
            new = await self._open_inbox()
        except Exception as exc:  # connection closing or gone: the old credit lapses by itself
            log.debug("pull inbox not renewed: %s", exc)
            return old
        await self._close_inbox(old)  # our server has dropped the old pull requests once this returns
        self._credit.clear()
        return new

    async def _close_inbox(self, sub: Subscription) -> None:
        """nats-py's drain, made to always let go of the subscription (its own keeps it registered,
        and resubscribes it after a reconnect, when the round trip fails)."""
        try:
            with anyio.move_on_after(self._expires):
                await self._nc._send_unsubscribe(sub._id)
                await self._nc.flush()  # every job sent before the server saw the UNSUB has arrived
        except Exception as exc:
            log.debug("pull inbox closed without a round trip: %s", exc)
        finally:
            self._nc._remove_sub(sub._id)

    async def _hand_back_strays(self) -> None:
        strays, self._strays = self._strays, []
        for msg in strays:
            await _nak(msg)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def _request(self, batch: int) -> None:
        self._counter += 1
        token = str(self._counter)
        self._credit.requested(token, batch, deadline=time.monotonic() + self._expires + 1.0)
        body = json.dumps({"batch": batch, "expires": int(self._expires * 1e9)}).encode()
        await self._nc.publish(self._next_subject, body, reply=f"{self._inbox}.{token}")

    def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status and not msg.data and not msg.reply:
            # A status comes to the pull's own reply subject, with no reply of its own; a job comes
            # with the job's subject and its ack subject (whatever headers a producer gave it).
            self.bound = True
            if status == "100":
                return
            if status not in ("404", "408"):
                desc = msg.headers.get("Description", "") if msg.headers else ""
                self._refusals.refused(time.monotonic(), f"{status} {desc}")
            else:
                self._refusals.answered()
            self._credit.ended(msg.subject.rsplit(".", 1)[-1], _pending(msg))
            self._wake.set()
            self._on_ended(status)
            return
        self.bound = True
        self._refusals.answered()
        self._credit.delivered()
        if not self._credit.total:  # its credit is spent: it may ask again at once (a shard puller)
            self._wake.set()
        if self._stopping or self._room() <= 0:
            # Not ours to run: a stray delivery after stop, or a forgotten pull that was honoured.
            self._strays.append(msg)
            self._wake.set()
            return
        self.pulled += 1
        self._on_job(msg)
