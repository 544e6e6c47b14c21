"""The producer side: submit jobs and read their frames.

    async with Client(url) as c:
        async for frame in c.generate(req):
            ...
        result = await c.complete(req)

One wildcard inbox subscription serves every request of a client; each request gets its own
reply subject under it, so thousands of concurrent requests cost one subscription.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import PubAck

from ..errors import (
    AcceptTimeout,
    DuplicateRequest,
    FrameGap,
    PayloadTooLarge,
    RequestFailed,
    WorkerSilent,
)
from ..schemas import (
    AcceptedFrame,
    CancelRequest,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    Frame,
    GenerateRequest,
    HeartbeatFrame,
    TokensFrame,
    Usage,
)
from . import codec
from .connection import connect
from .direct import subscribe_direct
from .names import Names
from .setup import QueuePolicy, check_server, ensure_streams

log = logging.getLogger(__name__)

HEADER_MARGIN = 512
"""Bytes kept free under max_payload for headers (nats-py only checks the body)."""


class Completion(msgspec.Struct, kw_only=True):
    """A finished request, assembled from its frames."""

    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage
    worker: str
    choices: list[Completion] = []
    """For n > 1: one entry per choice (index order); the top-level fields are choice 0's."""


class _Inbox:
    """Frames of one request: a deque and one waiter, lighter than asyncio.Queue on this hot path."""

    __slots__ = ("items", "waiter", "deadline")

    def __init__(self) -> None:
        self.items: deque[bytes | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.deadline: float | None = None

    def wait_for(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def put(self, data: bytes | None) -> None:
        self.items.append(data)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> bytes | None:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class Client:
    """A connection to one jetllm namespace, for producers."""

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str = "default",
        nc: NATS | None = None,
        heartbeat_timeout: float = 10.0,
        encoding: codec.Encoding = "msgpack",
        policy: QueuePolicy | None = None,
        name: str = "jetllm-producer",
    ) -> None:
        self.names = Names(namespace)
        self._url = url
        self._nc = nc
        self._own_nc = nc is None
        self._name = name
        self.heartbeat_timeout = heartbeat_timeout
        self.encoding = encoding
        self._policy = policy or QueuePolicy()
        self._inbox_root = ""
        self._sub = None
        self._inboxes: dict[str, _Inbox] = {}
        self._tg: TaskGroup | None = None

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("Client is not connected; use `async with Client(...)`")
        return self._nc

    async def __aenter__(self) -> Client:
        if self._nc is None:
            self._nc = await connect(self._url, name=self._name)
        try:
            await check_server(self._nc)
            self.js = self._nc.jetstream(timeout=10)
            await ensure_streams(self.js, self.names, self._policy)
            self._inbox_root = f"_INBOX.{uuid.uuid4().hex}"
            self._sub = await subscribe_direct(self._nc, f"{self._inbox_root}.*", self._on_frame)
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
            self._tg.start_soon(self._watchdog)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None
        if self._own_nc and self._nc is not None and not self._nc.is_closed:
            await self._nc.drain()
        self._nc = None

    def _on_frame(self, msg: Msg) -> None:
        inbox = self._inboxes.get(msg.subject[len(self._inbox_root) + 1 :])
        if inbox is not None:
            inbox.put(msg.data)

    async def _watchdog(self) -> None:
        """Wakes requests whose wait ran out; a timer per request per frame costs too much."""
        while True:
            await anyio.sleep(0.1)
            now = time.monotonic()
            for inbox in list(self._inboxes.values()):
                if inbox.deadline is not None and now > inbox.deadline:
                    inbox.put(None)

    # submitting

    def encode_job(self, req: GenerateRequest) -> bytes:
        data = codec.encode(req, self.encoding)
        limit = self.nc.max_payload - HEADER_MARGIN
        if len(data) > limit:
            raise PayloadTooLarge(
                f"job {req.request_id} is {len(data)} bytes; the NATS server accepts at most "
                f"{self.nc.max_payload} (max_payload) including ~{HEADER_MARGIN} bytes of headers"
            )
        return data

    async def submit(self, req: GenerateRequest, *, role: str = "generate") -> PubAck:
        """Publish a job durably; the PubAck says it is stored (or was a duplicate)."""
        data = self.encode_job(req)
        headers = {"Nats-Msg-Id": req.request_id, codec.CONTENT_TYPE: codec.content_type(self.encoding)}
        return await self.js.publish(self.names.jobs(role, req.model), data, headers=headers)

    async def cancel(self, request_id: str, reason: str | None = None) -> None:
        await self.nc.publish(
            self.names.cancel(request_id),
            codec.encode(CancelRequest(request_id=request_id, reason=reason)),
        )

    # streaming

    async def generate(
        self,
        req: GenerateRequest,
        *,
        role: str = "generate",
        accept_timeout: float | None = None,
    ) -> AsyncIterator[Frame]:
        """Submit `req` and yield its frames up to and including the final or error frame.

        Leaving the loop early (break, exception, task cancellation) cancels the request on the
        worker. Errors reported by the worker arrive as an ErrorFrame, not as an exception.
        Raises WorkerSilent when an accepted request goes quiet for `heartbeat_timeout`, and
        AcceptTimeout when no worker picks the job up within `accept_timeout` (None: wait).
        """
        token = uuid.uuid4().hex
        inbox = _Inbox()
        self._inboxes[token] = inbox
        if req.reply_to is None:
            req = msgspec.structs.replace(req, reply_to=f"{self._inbox_root}.{token}")
        elif not req.reply_to.startswith(self._inbox_root):
            raise ValueError("generate() sets reply_to itself; leave it None (or use submit())")
        finished = False
        try:
            ack = await self.submit(req, role=role)
            if ack.duplicate:
                raise DuplicateRequest(
                    f"request id {req.request_id!r} was already submitted (JetStream dropped this copy "
                    "as a duplicate); use a new request id for a new request"
                )
            last_seq = 0
            accepted = False
            inbox.wait_for(accept_timeout)
            decode = codec.frame_decoder.decode
            encoding = self.encoding
            while True:
                data = await inbox.get()
                if data is None:
                    if accepted:
                        raise WorkerSilent(
                            f"request {req.request_id}: no frame for {self.heartbeat_timeout:.1f}s "
                            "after the worker accepted it"
                        )
                    raise AcceptTimeout(
                        f"request {req.request_id}: no worker accepted it within {accept_timeout}s"
                    )
                frame = decode(data, encoding)
                if isinstance(frame, HeartbeatFrame):
                    if accepted:
                        inbox.wait_for(self.heartbeat_timeout)
                    if frame.seq > last_seq:
                        raise FrameGap(
                            f"request {req.request_id}: frames {last_seq + 1}..{frame.seq} were lost"
                        )
                    continue
                if frame.seq <= last_seq:
                    continue  # a duplicate
                if frame.seq != last_seq + 1:
                    raise FrameGap(
                        f"request {req.request_id}: expected frame {last_seq + 1}, got {frame.seq}"
                    )
                last_seq = frame.seq
                if isinstance(frame, AcceptedFrame):
                    accepted = True
                if accepted:
                    inbox.wait_for(self.heartbeat_timeout)
                yield frame
                if isinstance(frame, (FinalFrame, ErrorFrame)):
                    finished = True
                    return
        finally:
            self._inboxes.pop(token, None)
            if not finished and self._nc is not None and self._nc.is_connected:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.cancel(req.request_id, reason="producer stopped listening")
                    except Exception as exc:  # the request still ends: its worker stops on close
                        log.warning("could not send cancel for %s: %s", req.request_id, exc)

    async def complete(self, req: GenerateRequest, **kwargs: Any) -> Completion:
        """Run `req` to the end and return the assembled result; error frames raise RequestFailed."""
        n = req.sampling.n
        tokens: list[list[int]] = [[] for _ in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]
        any_text = False
        worker = ""
        started = time.monotonic()
        async for frame in self.generate(req, **kwargs):
            if isinstance(frame, TokensFrame):
                tokens[frame.index].extend(frame.token_ids)
                if frame.text is not None:
                    any_text = True
                    texts[frame.index].append(frame.text)
            elif isinstance(frame, AcceptedFrame):
                worker = frame.worker
            elif isinstance(frame, ErrorFrame):
                raise RequestFailed(frame.code, frame.message, field=frame.field)
            elif isinstance(frame, FinalFrame):
                choices = [
                    Completion(
                        request_id=req.request_id,
                        token_ids=tokens[c.index],
                        text="".join(texts[c.index]) if any_text else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        usage=frame.usage,
                        worker=worker,
                    )
                    for c in sorted(frame.choices, key=lambda c: c.index)
                ]
                first = choices[0]
                return msgspec.structs.replace(first, choices=choices if n > 1 else [])
        elapsed = time.monotonic() - started
        raise RequestFailed(  # pragma: no cover - generate() always ends with final or error
            ErrorCode.INTERNAL, f"{req.request_id} ended after {elapsed:.1f}s without a final frame"
        )

