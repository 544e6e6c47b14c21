"""The flow control of a transfer on the wire: the receiving side sends receipts on
`Names.kv_received(transfer_id)`, the sending side waits on them. The counting itself is in
window.py; transport.py (and the bench's plain path) move the blocks.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..schemas.disagg import KvReceived
from ..subjects import codec
from .window import Receipts, SendWindow

_receipt = codec.Decoder(KvReceived)

STALL_TIMEOUT = 10.0
"""Seconds a sender waits for a receipt with a whole window unconfirmed: then the receiver is gone
or cut off, and the transfer fails rather than holding the prefill slot."""


class Pacing:
    """The sending side: the window, and the receipts (subscribed to with `on_receipt`) that move
    it. Anything on the subject that is not a receipt, or claims more than was sent, moves nothing."""

    def __init__(self, window: int) -> None:
        self.window = SendWindow(window)
        self.sub: Any = None
        self._moved = anyio.Event()

    async def on_receipt(self, msg: Msg) -> None:
        try:
            receipt = _receipt.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if self.window.receipt(receipt.received):
            self._moved.set()

    async def wait(self) -> bool:
        """Whether the window lets the next message go before the receipts stall."""
        while not self.window.may_send():
            self._moved = anyio.Event()
            with anyio.move_on_after(STALL_TIMEOUT):
                await self._moved.wait()
            if not self._moved.is_set():
                return False
        return True

    def stall_message(self) -> str:
        unconfirmed = self.window.sent - self.window.received
        return (
            f"the decode worker confirmed nothing for {STALL_TIMEOUT:.0f}s with {unconfirmed:,} bytes "
            "unconfirmed: it is gone or cut off"
        )

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()


class Receiving:
    """The receiving side: counts every message on the transfer's subject and sends a receipt when
    one is due (window 0: never)."""

    def __init__(self, nc: NATS, subject: str, transfer_id: str, window: int) -> None:
        self._nc = nc
        self._subject = subject
        self._transfer_id = transfer_id
        self._receipts = Receipts(window) if window > 0 else None

    async def took(self, nbytes: int) -> None:
        total = self._receipts.add(nbytes) if self._receipts is not None else None
        if total is None:
            return
        receipt = KvReceived(transfer_id=self._transfer_id, received=total)
        with contextlib.suppress(Exception):  # a lost receipt: the next one carries the total
            await self._nc.publish(self._subject, codec.encode(receipt))
