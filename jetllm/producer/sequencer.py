"""What a producer makes of one request's frames and of its silences: plain synchronous decisions.

`Client.generate` hands the sequencer every frame and every wake-up of its timer, and carries out
what it is told (yield frames, read the request log, ping the worker, NAK the job); the rules of
the stream live here, so they can be tested row by row without NATS:

- `seq` counts output frames (tokens, final, error) from 1. A frame at or below the last one
  passed on is a duplicate (a worker that took the job over replays the log first); a frame
  beyond the next one means frames were lost, which are read back from the request log.
- Accepted and heartbeat frames repeat the last seq sent, so a heartbeat ahead of what arrived
  also reveals a loss. A frame from an older attempt than the newest accepted comes from a worker
  that lost the job. A frame of a kind this version does not know is skipped like one that never
  came (docs/messages.md, "Versioning and compatibility").
- A result read from the request log (to fill a gap, or after a silence) is outside input too:
  anyone who may publish to the log can write one. One that does not fit the request (per-choice
  lists of unequal length, more choices than it has, a final frame naming a choice twice or
  none at all) fails the request with RequestFailed (`internal`), as `error`, the way a frame
  naming a choice the request lacks fails it (completion.check_choices).
- The request log holds token frames only up to its last checkpoint: a worker that takes the
  request over asks the producer for the newer ones (`resume`), and from then on the older
  attempts' frames are dropped, so the stream goes on from exactly what the producer has.
- A worker is dead only when the server says so: a ping of its instance subject that has no
  responders (the server drops a connection's interest as soon as the connection closes). A ping
  that goes unanswered is a slow worker, never a dead one. So a short silence is enough to ping.
- A worker that pulled the job says so (`pulled`) before it reads the log and claims the job; until
  a worker accepts, the newest such worker is pinged the same way, so a death in between moves
  the job on at once rather than after the queue's ack_wait.
"""

from __future__ import annotations

import msgspec

from ..errors import AcceptTimeout, FrameGap, JetllmError, RequestFailed, WorkerSilent
from ..schemas import (
    AcceptedFrame,
    Delivered,
    ErrorFrame,
    FinalFrame,
    Frame,
    HeartbeatFrame,
    PulledFrame,
    Result,
    ResumeQuery,
    TokensFrame,
)
from ..subjects import codec
from .completion import check_result


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What to do after one event. At most one of `fill`, `lookup`, `probe` is set: do it and
    report the outcome (`filled`, `looked_up`, `probed`), which decides again. Otherwise yield
    `emit`, then raise `error` or stop at `end`."""

    emit: tuple[Frame, ...] = ()
    end: bool = False
    """The stream is over once `emit` is yielded."""
    error: JetllmError | None = None
    drop: str | None = None
    """Why the frame was not passed on."""
    fill: tuple[int, int] | None = None
    """Output frames with after < seq < before were lost: read them from the request log."""
    lookup: bool = False
    """Read the request's result from its log: it may have ended while its last frames were lost."""
    probe: str | None = None
    """Ping this worker: does its connection still exist?"""
    gone: str | None = None
    """This worker's connection is gone; its job moves on (NAK `nak`, when the worker gave one)."""
    nak: str | None = None

    @property
    def asks(self) -> bool:
        return self.fill is not None or self.lookup or self.probe is not None


NOTHING = Decision()
_decode = codec.frame_decoder.decode
_query_decoder = codec.Decoder(ResumeQuery)


class Sequencer:
    """One request's stream as its producer sees it. Every method takes the monotonic time of the event."""

    def __init__(
        self,
        request_id: str,
        now: float,
        *,
        encoding: codec.Encoding = "msgpack",
        migrate: bool = True,
        accept_timeout: float | None = None,
        heartbeat_timeout: float = 2.0,
        probe_after: float = 0.25,
        reconnects: int = 0,
        choices: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.choices = choices
        """The request's choices (`sampling.n`), to check a result read from the log against;
        None: unknown, a result is checked against itself (its `token_ids`)."""
        self.encoding = encoding
        self.migrate = migrate
        self.accept_timeout = accept_timeout
        self.heartbeat_timeout = heartbeat_timeout
        """Silence after which the log is read for a result (the last frames may be lost), and, with
        `migrate` off, after which the worker counts as silent."""
        self.probe_after = probe_after
        """Silence after which the worker is pinged, and again as often while it lasts."""
        self.attempt = 0
        self.accepted = False
        self.worker: str | None = None
        self.job_ack: str | None = None
        self.last_seq = 0
        self.seen: list[TokensFrame] = []
        """Token frames passed on, to tell what a result in the log adds to them."""
        self.floor = 0
        """Frames of attempts below this are dropped: a newer attempt continues from what we told it."""
        self.finished = False
        """A final or error frame was passed on: nothing is left to cancel."""
        self._held: Frame | None = None
        self.holder: PulledFrame | None = None
        """The newest worker that pulled the job, while none has accepted it."""
        self._suspect = False
        self._reconnects = reconnects
        self._accept_by = self._accept_deadline(now)
        self._heard = self._probe_at = self._lookup_at = now

    @property
    def deadline(self) -> float | None:
        """When to wake up (`wake`) if nothing arrives before."""
        if not self.accepted:
            if self.holder is not None and self.migrate:
                return self._probe_at if self._accept_by is None else min(self._probe_at, self._accept_by)
            return self._accept_by
        if not self.migrate:
            return self._heard + self.heartbeat_timeout
        return min(self._probe_at, self._lookup_at)

    # frames

    def receive(self, data: bytes, now: float) -> Decision:
        try:
            frame = _decode(data, self.encoding)
        except codec.UnknownKind as exc:  # a newer worker's extra information: not ours to read
            return Decision(drop=str(exc))
        except msgspec.DecodeError as exc:  # anyone may publish to an inbox; a lost real frame is a gap
            return Decision(drop=f"unreadable frame: {exc}")
        return self.frame(frame, now)

    def frame(self, frame: Frame, now: float) -> Decision:
        if frame.attempt < self.attempt or frame.attempt < self.floor:
            return Decision(drop="older attempt")  # from a worker that lost the job to a newer delivery
        if isinstance(frame, AcceptedFrame):
            return self._accepted(frame, now)
        if isinstance(frame, PulledFrame):
            return self._pulled(frame, now)
        if not self.accepted and self.worker is not None and frame.attempt == self.attempt:
            self.accepted = True  # the worker given up on is there after all: watch it again
        beat = isinstance(frame, HeartbeatFrame)
        if beat:
            self._alive(now)
        elif frame.seq <= self.last_seq:
            return Decision(drop="duplicate")
        before = frame.seq + 1 if beat else frame.seq  # a heartbeat carries the last seq sent
        if before > self.last_seq + 1:
            self._held = frame
            return Decision(fill=(self.last_seq, before))
        return self._next(frame, now)

    def filled(self, frames: list[Frame], now: float) -> Decision:
        """The frames `fill` asked for that the log had; then the frame that revealed the gap."""
        held, self._held = self._held, None
        self._passed(frames)
        if self.finished or held is None:
            return Decision(emit=tuple(frames), end=self.finished)
        then = self._next(held, now)
        return Decision(emit=(*frames, *then.emit), end=then.end, error=then.error)

    def _pulled(self, frame: PulledFrame, now: float) -> Decision:
        if self.accepted or (self.holder is not None and frame.attempt < self.holder.attempt):
            return Decision(drop="pulled by an attempt already superseded")
        self.holder = frame
        self._probe_at = now + self.probe_after
        return NOTHING

    def _accepted(self, frame: AcceptedFrame, now: float) -> Decision:
        if self.accepted and frame.attempt <= self.attempt:
            return Decision(drop="repeated accepted")
        self.holder = None
        self.accepted = True
        self._suspect = False
        self.attempt = frame.attempt
        self.worker, self.job_ack = frame.worker, frame.job_ack
        self._alive(now)
        return Decision(emit=(frame,))

    def _next(self, frame: Frame, now: float) -> Decision:
        if isinstance(frame, HeartbeatFrame):
            return NOTHING
        if frame.seq != self.last_seq + 1:
            return Decision(
                error=FrameGap(
                    f"request {self.request_id}: expected frame {self.last_seq + 1}, got {frame.seq}"
                )
            )
        self._alive(now)
        self._passed((frame,))
        return Decision(emit=(frame,), end=self.finished)

    def _passed(self, frames: list[Frame] | tuple[Frame, ...]) -> None:
        for frame in frames:
            self.last_seq = frame.seq
            if isinstance(frame, TokensFrame):
                self.seen.append(frame)
            elif isinstance(frame, (FinalFrame, ErrorFrame)):
                self.finished = True

    def _alive(self, now: float) -> None:
        if self.accepted:
            self._heard = now
            self._probe_at = now + self.probe_after
            self._lookup_at = now + self.heartbeat_timeout

    def resume(self, data: bytes) -> Delivered | None:
        """A worker taking the request over asks which token frames arrived after the log's last
        checkpoint (a ResumeQuery); None: not a question for this request, leave it unanswered."""
        try:
            query = _query_decoder.decode(data, self.encoding)
        except msgspec.DecodeError:
            return None
        if query.request_id != self.request_id:
            return None
        self.floor = max(self.floor, query.attempt)
        return Delivered(frames=[f for f in self.seen if f.seq > query.after])

    # silence

    def wake(self, now: float, *, connected: bool = True, reconnects: int = 0) -> Decision:
        """The timer ran out (`deadline`); `connected` and `reconnects` describe our own connection."""
        if not self.accepted:
            if self._accept_by is not None and now >= self._accept_by:
                return Decision(
                    error=AcceptTimeout(
                        f"request {self.request_id}: no worker accepted it within {self.accept_timeout}s"
                    )
                )
            if self.holder is not None and self.migrate and now >= self._probe_at:
                self._probe_at = now + self.probe_after
                return Decision(probe=self.holder.worker)
            return NOTHING
        if not self.migrate:
            if now >= self._heard + self.heartbeat_timeout:
                return Decision(
                    error=WorkerSilent(
                        f"request {self.request_id}: no frame for {self.heartbeat_timeout:.1f}s after the worker "
                        "accepted it"
                    )
                )
            return NOTHING
        if not connected or reconnects != self._reconnects:
            # We were cut off ourselves: the worker is probably fine (frames we missed meanwhile are
            # read from the log), and it may not have resubscribed yet: no pings for a while.
            self._reconnects = reconnects
            self._probe_at = max(self._probe_at, now + self.heartbeat_timeout)
        if now >= self._lookup_at:
            self._lookup_at = now + self.heartbeat_timeout
            return Decision(lookup=True)
        if now >= self._probe_at:
            self._probe_at = now + self.probe_after
            return Decision(probe=self.worker)
        return NOTHING

    def probed(self, gone: bool, now: float) -> Decision:
        """Whether the worker's ping had no responders. Before the job moves on, the log is read:
        a request that ended while its last frames were lost is answered from it."""
        if gone and not self.accepted and self.holder is not None:
            holder, self.holder = self.holder, None  # its delivery goes back; the next one says so
            return Decision(gone=holder.worker, nak=holder.job_ack)
        if not gone or not self.accepted:
            return NOTHING
        self._suspect = True
        return Decision(lookup=True)

    def looked_up(self, ended: Result | None, now: float) -> Decision:
        if ended is not None:  # it finished while its last frames were lost (a reconnect)
            try:
                frames = rest_of(ended, self.seen, self.last_seq, request_id=self.request_id, n=self.choices)
            except RequestFailed as exc:  # not finished: a forged result's request may still run
                return Decision(error=exc)
            self._passed(frames)
            return Decision(emit=tuple(frames), end=True)
        if not self._suspect or not self.accepted:
            return NOTHING
        self._suspect = False
        self.accepted = False
        self._accept_by = self._accept_deadline(now)
        return Decision(gone=self.worker, nak=self.job_ack)

    def _accept_deadline(self, now: float) -> float | None:
        return None if self.accept_timeout is None else now + self.accept_timeout


def rest_of(
    ended: Result,
    seen: list[TokensFrame],
    last_seq: int,
    *,
    request_id: str | None = None,
    n: int | None = None,
) -> list[Frame]:
    """The part of a finished request's output that `seen` lacks, as frames after `last_seq`.
    Raises RequestFailed (internal) for a result that does not fit the request (`check_result`,
    `n` its choices when known): the log is outside input."""
    check_result(request_id or "the request", ended, n)
    frames: list[Frame] = []
    seq = last_seq
    for index, ids in enumerate(ended.token_ids):
        have = [f for f in seen if f.index == index]
        n_ids = sum(len(f.token_ids) for f in have)
        text = None
        if ended.text:
            text = ended.text[index][len("".join(f.text or "" for f in have)) :]
        if ids[n_ids:] or text:
            seq += 1
            frames.append(
                TokensFrame(seq=seq, attempt=ended.attempt, index=index, token_ids=ids[n_ids:], text=text)
            )
    end = ended.final or ended.error
    if end is not None:  # always (check_result)
        frames.append(msgspec.structs.replace(end, seq=seq + 1))
    return frames
