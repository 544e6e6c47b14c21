"""Server-sent events for streamed completions, and the watch that turns a client hanging up
into a cancelled request.

A stream's status line waits for its first chunk: an error before any output (a 400 from the
worker, no worker taking the job) is still a plain HTTP error with its status; an error after it
is an `error` event, as vLLM's server sends it, followed by `[DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from anyio import CancelScope
from starlette.types import Receive, Scope, Send

from ..aio import task_group
from ..openai.errors import OpenAIError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
Emit = Callable[..., Awaitable[None]]
"""`emit(*chunks)`: the chunks go out as one write (one frame's chunks: one per choice it ends)."""
T = TypeVar("T")

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def json_response_parts(err: OpenAIError) -> tuple[dict[str, Any], dict[str, Any]]:
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    start = {"type": "http.response.start", "status": err.status, "headers": headers}
    return start, {"type": "http.response.body", "body": msgspec.json.encode(err.body())}


async def _watch(receive: Receive, scope: CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def unexpected(exc: Exception) -> OpenAIError:
    log.exception("gateway request failed", exc_info=exc)
    return OpenAIError(500, f"internal error in the gateway: {type(exc).__name__}", code="internal")


def leaf(group: BaseExceptionGroup) -> BaseException:
    """The one exception a task group wrapped (the watch never fails), else the group itself."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class Gone(Exception):
    """The client hung up before the answer was ready."""


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """`work()`, cancelled if the client hangs up first (then Gone): cancelling a job's stream
    cancels the job on its worker."""
    done: list[T] = []
    try:
        async with task_group() as tg:
            tg.start_soon(_watch, receive, tg.cancel_scope)
            done.append(await work())
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise leaf(group) from None
    if not done:
        raise Gone
    return done[0]


class EventStream:
    """An ASGI response that runs `produce(emit)` and sends each emitted object as an event."""

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], on_end: Callable[[int], None]) -> None:
        self.produce = produce
        self.on_end = on_end
        """Called once with the status the client saw (499: it hung up)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        status = 499
        # several jobs of one request emit from their own tasks; uncontended (one job), the lock
        # costs no trip through the event loop
        lock = anyio.Lock(fast_acquire=True)

        async def emit(*objs: dict[str, Any]) -> None:
            nonlocal started
            if not objs:
                return
            async with lock:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
                    started = True
                body = b"".join(event(obj) for obj in objs)
                await send({"type": "http.response.body", "body": body, "more_body": True})

        try:
            async with task_group() as tg:
                tg.start_soon(_watch, receive, tg.cancel_scope)
                try:
                    await self.produce(emit)
                    status = 200
                except OpenAIError as err:
                    status = await self._fail(err, started, emit, send)
                except Exception as exc:
                    status = await self._fail(unexpected(exc), started, emit, send)
                else:
                    if not started:  # nothing to say (never happens for a finished request)
                        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
                        started = True
                if started:
                    await send({"type": "http.response.body", "body": DONE, "more_body": False})
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if not isinstance(leaf(group), OSError):  # OSError: the connection broke under a send
                raise
            status = 499
        except OSError:
            status = 499
        finally:
            self.on_end(status)

    async def _fail(self, err: OpenAIError, started: bool, emit: Emit, send: Send) -> int:
        if started:
            await emit(err.body())
            return 200
        start, body = json_response_parts(err)
        await send(start)
        await send(body)
        return err.status
