"""Reading and writing the request log (see schemas/progress.py), and what a history means."""

from __future__ import annotations

import logging

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from ..schemas import Cancelled, Claim, Handoff, Record, Result, Step, TokensFrame
from ..subjects import codec
from ..subjects.names import Names

log = logging.getLogger(__name__)
_decoder = codec.Decoder(Record)


class History(msgspec.Struct, kw_only=True):
    """A request's log, as the attempt about to run it sees it."""

    result: Result | None = None
    cancelled: Cancelled | None = None
    frames: list[TokensFrame] = []
    """Token frames already sent, by seq, from the attempts that owned the request at the time."""
    deaths: int = 0
    """Earlier attempts that started and neither finished nor handed the request back."""
    handoffs: int = 0
    last_seq: int = 0
    claimed: bool = False

    @property
    def fresh(self) -> bool:
        return self.result is None and self.cancelled is None and not self.claimed

    def tokens(self, n: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(n)]
        for f in self.frames:
            if f.index < n:
                out[f.index].extend(f.token_ids)
        return out

    def texts(self, n: int) -> list[str] | None:
        if not any(f.text is not None for f in self.frames):
            return None
        out = ["" for _ in range(n)]
        for f in self.frames:
            if f.index < n and f.text is not None:
                out[f.index] += f.text
        return out


def analyze(records: list[Record]) -> History:
    """Fold a request's records into what the next attempt must know.

    A record of attempt a counts only while no later attempt has claimed the request: a slow
    worker that keeps writing after it was superseded cannot change what was delivered.
    """
    h = History()
    owner = 0
    claims: list[int] = []
    handed_back: set[int] = set()
    by_seq: dict[int, TokensFrame] = {}
    for r in records:
        if isinstance(r, Cancelled):  # the producer's word counts whoever owns the request...
            if h.result is None:  # ...unless the request had already ended
                h.cancelled = r
        elif isinstance(r, Result):  # so does the end, whoever wrote it
            h.result = r
            h.cancelled = None
        elif isinstance(r, Claim):
            if r.attempt > owner:
                owner = r.attempt
                claims.append(r.attempt)
        elif r.attempt < owner:
            continue
        elif isinstance(r, Step):
            by_seq.setdefault(r.frame.seq, r.frame)
        elif isinstance(r, Handoff):
            handed_back.add(r.attempt)
    h.claimed = bool(claims)
    h.handoffs = len(handed_back)
    h.deaths = sum(1 for a in claims if a not in handed_back)
    h.frames = [by_seq[s] for s in sorted(by_seq)]
    h.last_seq = max(by_seq, default=0)
    return h


class RequestLog:
    def __init__(self, nc: NATS, names: Names) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10)
        self.names = names

    async def write(self, request_id: str, record: Record) -> None:
        """Append a record. A plain publish: the stream stores it in connection order, before any
        frame published after it reaches the producer; no round trip on the token path."""
        await self.nc.publish(self.names.request_log(request_id), codec.encode(record))

    async def last(self, request_id: str) -> Record | None:
        try:
            raw = await self.js.get_last_msg(self.names.requests_stream, self.names.request_log(request_id), direct=True)
        except (nats.js.errors.NotFoundError, nats.errors.NoRespondersError):
            return None
        except nats.js.errors.APIError as exc:
            if getattr(exc, "code", None) == 404:
                return None
            raise
        if not raw.data:  # a direct get of a missing subject answers with an empty 404 message
            return None
        return _decoder.decode(raw.data)

    async def history(self, request_id: str) -> History:
        """Every record of the request, up to the last one stored when this is called."""
        subject = self.names.request_log(request_id)
        try:
            last = await self.js.get_last_msg(self.names.requests_stream, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return History()
        if not last.data:
            return History()
        records: list[Record] = []
        sub = await self.js.subscribe(subject, stream=self.names.requests_stream, ordered_consumer=True)
        try:
            with anyio.fail_after(30):
                while True:
                    msg = await sub.next_msg(timeout=30)
                    try:
                        records.append(_decoder.decode(msg.data))
                    except msgspec.DecodeError:
                        log.warning("request %s: skipping an unreadable log record", request_id)
                    if msg.metadata.sequence.stream >= last.seq:
                        break
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()
        return analyze(records)

    async def compact(self, request_id: str) -> None:
        """Keep only the last record (the Result) of a finished request."""
        try:
            await self.js.purge_stream(self.names.requests_stream, subject=self.names.request_log(request_id), keep=1)
        except Exception as exc:  # only costs space until max_age
            log.debug("request %s: compacting its log failed: %s", request_id, exc)
