"""A pulled JetStream message as a job: decoding with precise errors, and its acknowledgements."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.msg import Msg

from ..errors import RequestRejected
from ..schemas import SUPPORTED_VERSIONS, DeadLetter, ErrorCode
from ..subjects import codec
from ..subjects.codec import HEADER_MARGIN, field_path
from ..subjects.names import is_safe_reply_subject

log = logging.getLogger(__name__)


class RejectedJob(RequestRejected):
    """A job that failed to decode, with whatever could be salvaged to report it."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        field: str | None = None,
        request_id: str | None = None,
        reply_to: str | None = None,
        encoding: codec.Encoding = "msgpack",
    ) -> None:
        super().__init__(code, message, field=field)
        self.request_id = request_id
        self.reply_to = reply_to
        self.encoding = encoding


def salvage(data: bytes, headers: dict[str, str] | None) -> tuple[str | None, str | None, codec.Encoding]:
    """Request id, safe reply subject and encoding of a job that cannot be handled, as far as
    they can be read: whom to tell that it failed."""
    try:
        encoding = codec.encoding_of(headers)
    except codec.UnknownContentType:
        return None, None, "msgpack"
    _, rid, reply = _salvage(data, encoding)
    return rid, reply, encoding


def _salvage(data: bytes, encoding: codec.Encoding) -> tuple[object, str | None, str | None]:
    try:
        env = codec.envelope_decoder.decode(data, encoding)
    except Exception:
        if encoding != "json":
            return None, None, None
        try:  # invalid UTF-8 elsewhere in the job must not hide whom to tell
            env = codec.envelope_decoder.decode(bytes(data).decode("utf-8", "replace").encode(), encoding)
        except Exception:
            return None, None, None
    rid = env.request_id if isinstance(env.request_id, str) and len(env.request_id) <= 200 else None
    reply = env.reply_to if isinstance(env.reply_to, str) and is_safe_reply_subject(env.reply_to) else None
    return env.v, rid, reply


def decode_request(
    data: bytes, headers: dict[str, str] | None, decoder: codec.Decoder = codec.request_decoder
) -> tuple[Any, codec.Encoding]:
    """Decode and check a job; raises RejectedJob naming what is wrong.

    `decoder`: the job type of another role; it must carry the envelope's fields (`v`,
    `request_id`, `reply_to`), which every job does.
    """
    try:
        encoding = codec.encoding_of(headers)
    except codec.UnknownContentType as exc:
        raise RejectedJob(ErrorCode.MALFORMED, str(exc)) from None
    try:
        req = decoder.decode(data, encoding)
    except msgspec.ValidationError as exc:
        version, rid, reply = _salvage(data, encoding)
        if isinstance(version, int) and version not in SUPPORTED_VERSIONS:  # not a list or a map
            raise RejectedJob(
                ErrorCode.UNSUPPORTED_VERSION,
                f"schema version {version!r} is not supported (this worker speaks {sorted(SUPPORTED_VERSIONS)})",
                field="$.v",
                request_id=rid,
                reply_to=reply,
                encoding=encoding,
            ) from None
        text = str(exc)
        raise RejectedJob(
            ErrorCode.INVALID_REQUEST,
            text,
            field=field_path(text),
            request_id=rid,
            reply_to=reply,
            encoding=encoding,
        ) from None
    except msgspec.DecodeError as exc:
        _, rid, reply = _salvage(data, encoding)
        raise RejectedJob(
            ErrorCode.MALFORMED,
            f"not valid {encoding}: {exc}",
            request_id=rid,
            reply_to=reply,
            encoding=encoding,
        ) from None
    if req.v not in SUPPORTED_VERSIONS:
        raise RejectedJob(
            ErrorCode.UNSUPPORTED_VERSION,
            f"schema version {req.v} is not supported (this worker speaks {sorted(SUPPORTED_VERSIONS)})",
            field="$.v",
            request_id=req.request_id,
            reply_to=_safe(req.reply_to),
            encoding=encoding,
        )
    if req.reply_to is not None and not is_safe_reply_subject(req.reply_to):
        raise RejectedJob(
            ErrorCode.INVALID_REQUEST,
            "reply_to must be a plain subject outside `$...` and `jetllm.` (no wildcards or spaces)",
            field="$.reply_to",
            request_id=req.request_id,
            encoding=encoding,
        )
    return req, encoding


def _safe(reply: str | None) -> str | None:
    return reply if reply is not None and is_safe_reply_subject(reply) else None


SETTLE_TIMEOUT = 2.0
"""How long a settle waits for JetStream's confirmation before the slot frees anyway."""


class Job:
    """One delivery of a job message; settles it exactly once (ack, nak or term)."""

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        md = msg.metadata
        self.attempt = md.num_delivered
        self.stream_seq = md.sequence.stream
        self.subject = msg.subject
        self.settled = False
        self.settled_how: str | None = None
        self.last_progress = time.monotonic()
        self.stage = "decoding it"
        """What the worker is doing with the job, for the message of an unexpected failure."""

    async def _settle(self, how: str, payload: bytes) -> None:
        """Settle and wait for JetStream to confirm it (a double ack): the slot frees only once the
        server has processed it, so the server never counts more un-acked jobs for this worker than
        it has slots (an ack still in flight when the next pull arrives would be counted beside the
        job that pull brings). Without a confirmation in time the job is settled anyway: the
        message was sent, and a lost one only means a redelivery after ack_wait."""
        if self.settled:
            return
        self.settled = True
        self.settled_how = how
        with anyio.CancelScope(shield=True):
            try:
                await self.msg._client.request(self.msg.reply, payload, timeout=SETTLE_TIMEOUT)
            except nats.errors.TimeoutError:
                log.info("job seq %d: %s not confirmed within %.0fs", self.stream_seq, how, SETTLE_TIMEOUT)
            except Exception as exc:  # the server redelivers after ack_wait; nothing is lost
                log.warning("job seq %d: %s failed: %s", self.stream_seq, how, exc)

    async def ack(self) -> None:
        await self._settle("ack", b"+ACK")

    async def nak(self, delay: float | None = None) -> None:
        payload = b"-NAK" + (b' {"delay": %d}' % int(delay * 1e9) if delay else b"")
        await self._settle("nak", payload)

    async def term(self) -> None:
        await self._settle("term", b"+TERM")

    async def in_progress(self) -> None:
        if self.settled:
            return
        self.last_progress = time.monotonic()
        try:
            await self.msg.in_progress()
        except Exception as exc:
            log.warning("job seq %d: in_progress failed: %s", self.stream_seq, exc)


def dead_letter_record(
    *,
    subject: str,
    payload: bytes,
    headers: dict[str, str] | None,
    code: ErrorCode,
    reason: str,
    worker: str,
    deliveries: int,
    request_id: str | None,
    max_payload: int | None = None,
) -> DeadLetter:
    """The record for the DLQ stream, built here for every way a job dies so that it always fits
    one message: a job near max_payload (big prompts, inline embeddings) cannot also fit beside its
    reason, so it is recorded without its payload (and, if need be, its headers) rather than not
    at all, which would leave it in the queue and its producer without an answer."""
    record = DeadLetter(
        code=code,
        reason=reason[:4000],
        subject=subject,
        deliveries=deliveries,
        worker=worker,
        failed_at=time.time(),
        request_id=request_id,
        headers=dict(headers or {}),
        payload=bytes(payload),
    )
    if max_payload is None:
        return record
    room = max_payload - HEADER_MARGIN
    if len(codec.encode(record)) <= room:
        return record
    dropped = f"payload of {len(record.payload)} bytes"
    record = msgspec.structs.replace(
        record, payload=b"", reason=f"{record.reason} [{dropped} not kept: too big for a dead letter]"
    )
    if len(codec.encode(record)) <= room:
        return record
    reason = f"{reason[:4000]} [{dropped} and headers not kept: too big for a dead letter]"
    return msgspec.structs.replace(record, headers={}, reason=reason)
