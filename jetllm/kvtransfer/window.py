"""Flow control of one transfer: the prefill side keeps at most a window of bytes beyond what the
decode side has said it received.

Without it a prefill worker publishes as fast as its socket takes the bytes, and a decode worker
whose event loop is busy (or merely slower) falls behind by more than the server buffers for one
connection (`max_pending`, 64 MB by default). The server then cuts the decode worker's connection
as a slow consumer, and with it every token stream that worker serves. Pure counting here; the
receipts travel in pacing.py.
"""

from __future__ import annotations

WINDOW_BYTES = 16 << 20
"""What a decode worker lets be in flight: a quarter of nats-server's default max_pending, so a
window plus one message of the largest max_payload (8 MB) stays well under it."""


class SendWindow:
    """The prefill side's count. A message goes while less than the window is unconfirmed, so at
    most a window plus one message is in flight, whatever the message size."""

    __slots__ = ("size", "sent", "received")

    def __init__(self, size: int) -> None:
        self.size = size
        """0: no flow control (a decode worker that sends no receipts)."""
        self.sent = 0
        self.received = 0

    def may_send(self) -> bool:
        return self.size <= 0 or self.sent - self.received < self.size

    def sending(self, nbytes: int) -> None:
        self.sent += nbytes

    def receipt(self, received: int) -> bool:
        """Take the decode side's running total; whether it moved the window. A total that is
        stale, or claims more than was sent (a forged receipt), moves nothing."""
        if self.received < received <= self.sent:
            self.received = received
            return True
        return False


class Receipts:
    """The decode side's count: a receipt is due every quarter window, so the sender, blocked with
    a whole window unconfirmed, always hears back before the receiver has everything."""

    __slots__ = ("step", "received", "confirmed")

    def __init__(self, window: int) -> None:
        self.step = max(1, window // 4)
        self.received = 0
        self.confirmed = 0

    def add(self, nbytes: int) -> int | None:
        """Count a message of `nbytes`; the total to confirm when a receipt is due, else None."""
        self.received += nbytes
        if self.received - self.confirmed < self.step:
            return None
        self.confirmed = self.received
        return self.received
