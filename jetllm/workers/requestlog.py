"""Reading and writing the request log (see schemas/requestlog.py), and what a history means."""

from __future__ import annotations

import logging

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from ..aio import retried
from ..schemas import (
    Cancelled,
    ChoiceLogprobs,
    Claim,
    ErrorCode,
    ErrorFrame,
    Handoff,
    Record,
    Result,
    Step,
    Steps,
    TokensFrame,
)
from ..subjects import codec, streamread
from ..subjects.names import Names

log = logging.getLogger(__name__)
_decoder = codec.KindDecoder(Record)
_cancel_decoder = codec.Decoder(Cancelled)

ROLLUP = {"Nats-Rollup": "sub"}
"""On a result: the stream keeps it alone, the request's earlier records go as it is stored."""
ROLLUP_REFUSED = 10111
"""JetStream's error code for a rollup on a stream that does not allow them."""
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for a conditional write whose subject is not where it expected."""
FIRST = {"Nats-Expected-Last-Subject-Sequence": "0"}
"""On a claim: stored only while the request's log is empty."""


class Unreadable:
    """The last record is one this version cannot read (a newer worker's kind): read the history,
    which leaves such records out, instead of failing the job."""

    __slots__ = ()


class LogUnavailable(Exception):
    """The request log could not be read (JetStream restarting or unreachable): the job must wait,
    as running it blind could run a finished or running request again."""


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
    last_attempt: int = 0
    owner: str | None = None
    """The worker of the newest claim, while the request has not ended nor been handed back by it."""
    """The highest attempt that claimed the request; a broker restored from disk may count deliveries
    from 1 again, so the next attempt numbers itself above this."""

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

    def logprobs(self, n: int) -> list[ChoiceLogprobs]:
        out = [ChoiceLogprobs(logprobs=[]) for _ in range(n)]
        chars = [0] * n
        for f in self.frames:
            if f.index < n:
                keep_logprobs(out[f.index], f.token_ids, f.logprobs, f.top_logprobs, chars[f.index])
                chars[f.index] += len(f.text or "")
        return out


class KeptLogprobs:
    """What a Result holds of its choices' log-probabilities: nothing unless the job asked."""

    def __init__(self, history: History, n: int, asked: bool) -> None:
        self.choices = history.logprobs(n) if asked else None

    def add(
        self,
        index: int,
        token_ids: list[int],
        logprobs: list[float] | None,
        top: list[dict[int, float]] | None,
        texts: list[str] | None,
    ) -> None:
        """A frame about to be sent; `texts` is every choice's text before the frame's."""
        if self.choices is not None:
            keep_logprobs(self.choices[index], token_ids, logprobs, top, len(texts[index]) if texts else 0)


def keep_logprobs(
    kept: ChoiceLogprobs,
    token_ids: list[int],
    logprobs: list[float] | None,
    top: list[dict[int, float]] | None,
    offset: int,
) -> None:
    """Add one frame's log-probabilities to its choice's; `offset` is where the frame's text
    begins. Missing top entries are kept as empty ones, so the lists stay per token."""
    k = len(token_ids)
    kept.logprobs.extend(logprobs or [])
    tops = top or []
    kept.top_logprobs.extend(tops[:k] + [{}] * (k - len(tops)))
    kept.text_offsets.extend([offset] * k)


def fitted(result: Result, limit: int) -> Result:
    """`result`, or, when its log-probabilities make it larger than a message may be (`limit`
    bytes), an error naming them: a Result that cannot be stored would leave its reader (a batch
    line) waiting for ever."""
    if not result.logprobs:
        return result
    size = len(codec.encode(result))
    if size <= limit:
        return result
    error = ErrorFrame(
        seq=result.final.seq if result.final else 1,
        request_id=result.final.request_id if result.final else None,
        code=ErrorCode.PAYLOAD_TOO_LARGE,
        message=f"the output with its log-probabilities is {size} bytes, more than a stored result may "
        f"be ({limit}, the server's max_payload); ask for fewer top log-probabilities or tokens",
        field="$.output.logprobs",
    )
    return Result(attempt=result.attempt, error=error, worker=result.worker, migrations=result.migrations)


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
                h.owner = r.worker
        elif r.attempt < owner:
            continue
        elif isinstance(r, Steps):
            for f in r.frames:
                by_seq.setdefault(f.seq, f)
        elif isinstance(r, Step):
            by_seq.setdefault(r.frame.seq, r.frame)
        elif isinstance(r, Handoff):
            handed_back.add(r.attempt)
    h.claimed = bool(claims)
    if h.result is not None or h.cancelled is not None or owner in handed_back:
        h.owner = None
    h.last_attempt = owner
    h.handoffs = len(handed_back)
    h.deaths = sum(1 for a in claims if a not in handed_back)
    h.frames = [by_seq[s] for s in sorted(by_seq)]
    h.last_seq = max(by_seq, default=0)
    return h


def with_cancel(history: History, cancel: Cancelled | None) -> History:
    """`history` with the producer's durable cancel (stored apart from the log): it counts unless
    the request has already ended, as a cancel in the log does."""
    if cancel is None or history.result is not None:
        return history
    return msgspec.structs.replace(history, cancelled=cancel, owner=None)


def read_cancel(data: bytes | None) -> Cancelled:
    """A durable cancel as stored. Producers write that subject, so its content is not trusted to
    be anything but a cancel: whatever is there cancels, and only a readable reason is kept."""
    try:
        return _cancel_decoder.decode(data or b"")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Cancelled(attempt=0)


def contiguous_after(after: int, frames: list[TokensFrame]) -> list[TokensFrame]:
    """The frames that continue seq `after` with no gap (a producer's answer is not trusted blindly)."""
    out: list[TokensFrame] = []
    for f in sorted(frames, key=lambda f: f.seq):
        if f.index < 0 or any(t < 0 for t in f.token_ids):
            break  # not a frame a worker sent
        if f.seq == after + len(out) + 1:
            out.append(f)
        elif f.seq > after + len(out) + 1:
            break
    return out


def with_delivered(history: History, frames: list[TokensFrame]) -> History:
    """`history` plus the token frames the producer reported after its last seq."""
    if not frames:
        return history
    return msgspec.structs.replace(history, frames=history.frames + frames, last_seq=frames[-1].seq)


class RequestLog:
    def __init__(self, nc: NATS, names: Names) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10)
        self.names = names
        self._told_refused = False

    async def write(self, request_id: str, record: Record) -> None:
        """Append a record. A plain publish: the stream stores it in connection order, before any
        frame published after it reaches the producer; no round trip on the token path."""
        await self.nc.publish(self.names.request_log(request_id), codec.encode(record))

    async def write_stored(
        self, request_id: str, record: Record, *, within: float = 60.0, rollup: bool = False
    ) -> None:
        """Append a record and wait until the stream has stored it, retrying across a broker restart.

        For records that decide whether a job runs again (results, and steps rewritten after a
        reconnect): a plain publish that reaches a server still recovering its streams is dropped.
        """
        subject, data = self.names.request_log(request_id), codec.encode(record)
        try:  # each publish waits 5 s at most, so this ends within `within` plus 5 s
            await retried(
                lambda: self._publish(subject, data, rollup),
                errors=(nats.errors.Error, TimeoutError),
                within=within,
                what=f"request {request_id}: storing a {type(record).__name__} record",
                first=0.2,
                longest=2.0,
            )
        except (nats.errors.Error, TimeoutError):
            raise LogUnavailable(
                f"request log: could not store a {type(record).__name__} record in {within:.0f}s"
            ) from None

    async def _publish(self, subject: str, data: bytes, rollup: bool) -> None:
        if rollup:
            try:
                await self.js.publish(subject, data, timeout=5, headers=ROLLUP)
                return
            except nats.js.errors.APIError as exc:
                if exc.err_code != ROLLUP_REFUSED:
                    raise
                if not self._told_refused:  # once: it is the stream's setting, not this job's
                    self._told_refused = True
                    log.warning(
                        "request log: the stream refuses rollups; results are stored beside their logs"
                    )
        await self.js.publish(subject, data, timeout=5)

    async def claim_first(self, request_id: str, claim: Claim) -> bool:
        """Write `claim` only while the request's log is empty: False (nothing written) when it
        is not. One round trip where reading the log and then claiming takes two, for a request
        that is most likely new; raises LogUnavailable when the server does not answer."""
        try:
            await self.js.publish(
                self.names.request_log(request_id), codec.encode(claim), timeout=5, headers=FIRST
            )
        except nats.js.errors.APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise LogUnavailable(f"request log: claim not stored: {exc}") from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise LogUnavailable(f"request log: claim not stored: {type(exc).__name__}") from None
        return True

    async def store_result(self, request_id: str, result: Result) -> None:
        """Store a request's end before acking its job, so a redelivery answers from it, not reruns.

        The result rolls the request's subject up: the claims and steps before it served only to
        resume the request, and dropping them with the same write costs no request of its own."""
        try:
            await self.write_stored(
                request_id, fitted(result, self.nc.max_payload - codec.HEADER_MARGIN), rollup=True
            )
        except LogUnavailable as exc:
            log.warning(
                "request %s: its result is not in the log (%s); a redelivery would run it again",
                request_id,
                exc,
            )

    async def _stored_last(self, stream: str, subject: str, what: str) -> tuple[bytes, int] | None:
        """The data and stream sequence of the last message stored on `subject`, by one direct get
        (which any copy of the stream answers); None when there is none."""
        try:
            raw = await self.js.get_last_msg(stream, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        except nats.js.errors.APIError as exc:
            if getattr(exc, "code", None) == 404:
                return None
            raise LogUnavailable(f"{what}: {exc}") from exc
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise LogUnavailable(f"{what}: {type(exc).__name__}") from exc
        if not raw.data:  # a missing subject may answer with an empty 404 message
            return None
        return raw.data, raw.seq or 0

    async def last(self, request_id: str) -> Record | Unreadable | None:
        raw = await self._stored_last(
            self.names.requests_stream, self.names.request_log(request_id), "request log"
        )
        if raw is None:
            return None
        try:
            return _decoder.decode(raw[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("request %s: last log record unreadable here (%s); reading its history", request_id, exc)
            return Unreadable()

    async def cancel(self, request_id: str) -> Cancelled | None:
        """The producer's durable cancel of the request, if it stored one (not in the log: see
        Client.cancel). Read with one direct get, like the log."""
        raw = await self._stored_last(
            self.names.cancels_stream, self.names.cancelled(request_id), "durable cancels"
        )
        return None if raw is None else read_cancel(raw[0])

    async def history(self, request_id: str) -> History:
        """Every record of the request, up to the last one stored when this is called (the log
        alone: `with_cancel` adds the producer's durable cancel). Read with
        direct gets (subjects/streamread.py), which work in the seconds after a cluster member
        died, when creating a consumer to read it may not."""
        subject = self.names.request_log(request_id)
        last = await self._stored_last(self.names.requests_stream, subject, "request log")
        if last is None or not last[1]:
            return History()
        last_seq = last[1]
        records: list[Record] = []
        read_to = 0
        try:
            async for raw in streamread.messages(self.js, self.names.requests_stream, subject, upto=last_seq):
                read_to = raw.seq or read_to
                try:
                    records.append(_decoder.decode(raw.data or b""))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("request %s: skipping an unreadable log record: %s", request_id, exc)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise LogUnavailable(f"request log: reading it stopped: {type(exc).__name__}") from exc
        if read_to < last_seq:  # answered by a copy that is behind the one that gave `last`
            raise LogUnavailable(f"request log: read to seq {read_to} of {last_seq}")
        return analyze(records)
