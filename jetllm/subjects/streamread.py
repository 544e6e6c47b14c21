"""Reading one subject of a stream message by message, with direct gets.

Any live server holding a copy of a stream (with `allow_direct`) answers a direct get, and
nothing is created for it. A consumer, even an ephemeral ordered one, must first be placed on one
of the stream's servers by the meta leader: for some seconds after a cluster member dies, about a
third of those placements land on the dead member and the creation times out. A producer filling
a gap, or a worker taking over a request, cannot wait that out, so the request log is read this
way: one round trip per record, which checkpoints keep few per request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg


async def messages(
    js: JetStreamContext, stream: str, subject: str, *, start: int = 1, upto: int | None = None
) -> AsyncGenerator[RawStreamMsg, None]:
    """The messages on `subject` from stream sequence `start` on, in order, up to sequence
    `upto` (None: as far as the answering server has them now)."""
    seq = max(start, 1)
    while upto is None or seq <= upto:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
        except nats.js.errors.NotFoundError:
            return
        if msg.seq is None or (upto is not None and msg.seq > upto):
            return
        yield msg
        seq = msg.seq + 1
