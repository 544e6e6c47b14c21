"""What every generation endpoint shares: the gateway's connections and settings, reading a
body, routing a model, and running jobs with their failures turned into HTTP errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..aio import task_group
from ..batches.plan import MAX_IN_FLIGHT, REFILL_SECONDS, SHARD_LINES
from ..errors import JetllmError, RequestFailed
from ..openai.errors import OpenAIError, from_code, from_exception, too_large
from ..openai.translate import Job, Route, decode, param_of
from ..producer import Client
from ..producer.completion import check_choices
from ..schemas import ErrorCode, ErrorFrame, FinalFrame, TokensFrame
from .capacity import FleetView, admit, unreachable
from .metrics import GatewayMetrics
from .sse import Emit, EventStream, Gone, unexpected, until_disconnect

log = logging.getLogger(__name__)

OnFrame = Callable[[int, TokensFrame | FinalFrame], Awaitable[None]]


@dataclass
class GatewayConfig:
    nats_url: str | None = None
    """None: $NATS_URL, else the local default (subjects/connection.py)."""
    namespace: str = "default"
    max_queue: int | None = None
    """Refuse (429) a request while its model has more than this many jobs waiting; None: never."""
    retry_after: int = 2
    """Seconds a 429 or 503 tells the client to wait (Retry-After)."""
    accept_timeout: float = 60.0
    """A job no worker takes within this long is cancelled and answered 503."""
    max_body_bytes: int = 16 << 20
    """Bigger request bodies are refused with 413 before they are read to the end."""
    batches: BatchSettings | None = None
    """Serve /v1/files and /v1/batches and run a batch runner in the gateway; None: neither."""


@dataclass(frozen=True)
class BatchSettings:
    """The gateway's files and batches endpoints and its batch runner (docs/operations.md)."""

    window: int
    """Jobs of one batch waiting in the queue at once (running ones do not count)."""
    batches: int
    """Batches this gateway's runner runs at once."""
    ack_wait: float | None
    """Seconds after which a batch whose runner went silent goes to another runner; None: the
    runners' consumer keeps what it has."""
    max_file_bytes: int
    """The largest upload; more is a 413."""
    most: int = MAX_IN_FLIGHT
    """Jobs of one batch queued or running at once."""
    refill: float = REFILL_SECONDS
    """Seconds a line that ended may have its replacement queued beyond the window."""
    shard: int = SHARD_LINES
    """Lines of one model sent together as one shard job; 1: each line a job of its own."""


class Gateway:
    """The connections of one gateway process; held by the app (app.state.gateway) for its life."""

    def __init__(self, config: GatewayConfig, client: Client, fleet: FleetView) -> None:
        self.config = config
        self.client = client
        self.fleet = fleet
        self.metrics = GatewayMetrics()

    async def body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(f"the request body is {declared} bytes; the gateway takes at most {limit}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"the request body exceeds {limit} bytes, the most the gateway takes")
                chunks.append(chunk)
        except ClientDisconnect:  # counted as any client that hangs up; nobody reads the answer
            raise OpenAIError(
                499, "the client hung up while sending the body", code=ErrorCode.CANCELLED.value
            ) from None
        return b"".join(chunks)

    async def parse(self, request: Request, kind: type[Any]) -> Any:
        return decode(await self.body(request), kind)

    async def route(self, model: str) -> Route:
        return await self.fleet.route(model, self.config.retry_after)

    async def admit(self, route: Route, jobs: int = 1) -> None:
        """Refuse (429) a request whose `jobs` would wait behind too many (`--max-queue`)."""
        if self.config.max_queue is not None:
            depth = await self.fleet.depth(route.model)
            admit(route.model, depth, self.config.max_queue, self.config.retry_after, jobs)

    async def run(self, jobs: Sequence[Job], on_frame: OnFrame) -> None:
        """Run the jobs at once, handing their token and final frames on (with the job's index);
        the first failure ends them all (each one left unfinished is cancelled on its worker)."""
        if len(jobs) == 1:
            await self._run_one(0, jobs[0], on_frame)
            return
        try:
            async with task_group() as tg:
                for i, job in enumerate(jobs):
                    tg.start_soon(self._run_one, i, job, on_frame)
        except BaseExceptionGroup as group:
            first = _first(group)
            if first is not None:
                raise first from None
            raise

    async def _run_one(self, i: int, job: Job, on_frame: OnFrame) -> None:
        try:
            frames = self.client.generate(job.request, accept_timeout=self.config.accept_timeout)
            async with aclosing(frames):
                async for frame in frames:
                    if isinstance(frame, ErrorFrame):
                        raise from_code(
                            frame.code,
                            frame.message,
                            param=param_of(frame.field, job.params),
                            retry_after=self.config.retry_after,
                        )
                    if isinstance(frame, (TokensFrame, FinalFrame)):
                        _check_choices(job, frame)
                        await on_frame(i, frame)
        except JetllmError as exc:
            raise from_exception(exc, retry_after=self.config.retry_after) from None
        except nats.errors.Error as exc:
            raise unreachable(exc, self.config.retry_after) from None


def _check_choices(job: Job, frame: TokensFrame | FinalFrame) -> None:
    """Frames come from outside the gateway (whoever may publish to the job's inbox): one naming
    a choice the request lacks, or a final frame that misses a choice or names one twice, fails
    the request as a producer's does (`completion.check_choices`): a 500 `internal` naming the
    choice, not an IndexError of the gateway's, nor another prompt's choice filled."""
    try:
        check_choices(job.request, frame)
    except RequestFailed as exc:
        raise _malformed(exc.remote_message) from None


def _malformed(message: str) -> OpenAIError:
    log.warning("a reply frame does not fit its request: %s", message)
    return from_code(ErrorCode.INTERNAL, message)


def _first(group: BaseExceptionGroup) -> OpenAIError | None:
    for exc in group.exceptions:
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc)
            if found is not None:
                return found
    return None


def created() -> int:
    return int(time.time())


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status, headers, media_type="application/json")


def error_response(err: OpenAIError) -> Response:
    return json_response(err.body(), err.status, err.headers())


async def answer(
    gw: Gateway,
    request: Request,
    endpoint: str,
    whole: Callable[[], Awaitable[dict[str, Any]]],
    stream: Callable[[Emit], Awaitable[None]] | None,
) -> Response | EventStream:
    """Run a prepared request, whole (cancelled if the client hangs up) or streamed, counting it."""
    started = time.monotonic()
    gw.metrics.in_flight.inc()

    def ended(status: int) -> None:
        gw.metrics.in_flight.dec()
        gw.metrics.answered(endpoint, status, time.monotonic() - started)

    if stream is not None:
        return EventStream(stream, ended)
    status = 500
    try:
        result = await until_disconnect(request.receive, whole)
        status = 200
        return json_response(result)
    except OpenAIError as err:
        status = err.status
        return error_response(err)
    except Gone:
        status = 499
        return Response(status_code=499)
    except Exception as exc:
        failure = unexpected(exc)
        status = failure.status
        return error_response(failure)
    finally:
        ended(status)


def refused(gw: Gateway, endpoint: str, err: OpenAIError) -> Response:
    """A request refused before any job was made."""
    gw.metrics.answered(endpoint, err.status, 0.0)
    return error_response(err)
