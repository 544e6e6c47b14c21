"""Fault injection for tests: an unexpected exception at one stage of a job's way through a worker.

A job asks for a fault by carrying `<kind>-<stage>` in its request id (or, for the stages that
see no request id, in its bytes or prompt). Kind `fault` raises InjectedFault; kind `stray`
raises the CancelledError a task meets when a future it awaits is cancelled by a library (no
cancel scope of the worker asked for it). The patches wrap the real methods and change nothing
for other jobs, so one worker serves faulty and healthy jobs side by side. Used in-process (fake
engine) and in a `jetllm worker` process (tests/helpers/faulty_worker.py, real vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from jetllm.schemas import Claim, FinalFrame, TraceRecord


class InjectedFault(RuntimeError):
    pass


STAGES = (
    "decode",
    "log",
    "render",
    "claim",
    "accepted",
    "engine",
    "tokens",
    "result",
    "final",
    "trace",
)


KINDS = ("fault", "stray")


def _marked(value: Any, stage: str) -> str | None:
    """The kind of fault `value` (a request id, a prompt's repr, a job's bytes) asks for at `stage`."""
    if isinstance(value, bytes | bytearray | memoryview):
        value = bytes(value).decode(errors="replace")
    if not isinstance(value, str):
        return None
    return next((kind for kind in KINDS if f"{kind}-{stage}" in value), None)


def _raise_if(stage: str, kind: str | None) -> None:
    if kind == "fault":
        raise InjectedFault(stage)
    if kind == "stray":
        raise asyncio.CancelledError(f"injected at {stage}: a future cancelled by a library")


def _decode(orig):
    @functools.wraps(orig)
    def f(data, headers):
        _raise_if("decode", _marked(data, "decode"))
        return orig(data, headers)

    return f


def _by_request_id(stage: str, when: Any = None):
    """A coroutine method whose first argument is the request id."""

    def wrap(orig):
        async def f(self, request_id, *args, **kw):
            _raise_if(stage, _marked(request_id, stage) if when is None or when(*args) else None)
            return await orig(self, request_id, *args, **kw)

        return f

    return wrap


def _by_sink(stage: str, when: Any = None):
    """A coroutine method of FrameSink: its request id is on the sink."""

    def wrap(orig):
        async def f(self, *args, **kw):
            _raise_if(stage, _marked(self.request_id, stage) if when is None or when(*args) else None)
            return await orig(self, *args, **kw)

        return f

    return wrap


def _render(orig):
    async def f(self, prompt):
        _raise_if("render", _marked(repr(prompt), "render"))
        return await orig(self, prompt)

    return f


def _generate(orig):
    def f(self, req, *args, **kw):
        kind = _marked(req.request_id, "engine")
        if kind is not None:

            async def boom():
                _raise_if("engine", kind)
                yield  # an async generator, like the engine's

            return boom()
        return orig(self, req, *args, **kw)

    return f


def _trace(orig):
    async def f(self, rec: TraceRecord):
        _raise_if("trace", _marked(rec.request_id, "trace"))
        return await orig(self, rec)

    return f


def _patches(engine_cls: type) -> list[tuple[Any, str, Any]]:
    from jetllm.workers.frames import FrameSink
    from jetllm.workers.requestlog import RequestLog
    from jetllm.workers.roles.generate import role
    from jetllm.workers.tracing import TracePublisher

    return [
        (role, "decode_request", _decode),
        (RequestLog, "last", _by_request_id("log")),
        (engine_cls, "render", _render),
        (RequestLog, "write", _by_request_id("claim", lambda record: isinstance(record, Claim))),
        (FrameSink, "accepted", _by_sink("accepted")),
        (engine_cls, "generate", _generate),
        (FrameSink, "tokens", _by_sink("tokens")),
        (RequestLog, "store_result", _by_request_id("result", lambda result: result.final is not None)),
        (FrameSink, "send", _by_sink("final", lambda frame: isinstance(frame, FinalFrame))),
        (TracePublisher, "publish", _trace),
    ]


def install(engine_cls: type) -> list[tuple[Any, str, Any]]:
    """Patch every stage; returns what to put back."""
    saved = []
    for owner, name, wrap in _patches(engine_cls):
        orig = getattr(owner, name)
        saved.append((owner, name, orig))
        setattr(owner, name, wrap(orig))
    return saved


@contextlib.contextmanager
def installed(engine_cls: type) -> Iterator[None]:
    saved = install(engine_cls)
    try:
        yield
    finally:
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)
