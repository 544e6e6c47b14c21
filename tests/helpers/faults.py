"""Fault injection for tests: an unexpected exception at one stage of a job's way through a worker.

A job asks for a fault by carrying `fault-<stage>` in its request id (or, for the stages that
see no request id, in its bytes or prompt). The patches wrap the real methods and change nothing
for other jobs, so one worker serves faulty and healthy jobs side by side. Used in-process (fake
engine) and in a `jetllm worker` process (tests/helpers/faulty_worker.py, real vLLM).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from jetllm.schemas import Claim, FinalFrame, Result, TraceRecord


class InjectedFault(RuntimeError):
    pass


STAGES = ("decode", "log", "render", "claim", "accepted", "engine", "tokens", "result", "final", "trace",
          "compact")


def _marked(value: Any, stage: str) -> bool:
    return isinstance(value, str) and f"fault-{stage}" in value


def _patches(engine_cls: type) -> list[tuple[Any, str, Any]]:
    from jetllm.workers import jobrun
    from jetllm.workers.frames import FrameSink
    from jetllm.workers.requestlog import RequestLog
    from jetllm.workers.tracing import TracePublisher

    def decode(orig):
        @functools.wraps(orig)
        def f(data, headers):
            if b"fault-decode" in bytes(data):
                raise InjectedFault("decode")
            return orig(data, headers)
        return f

    def last(orig):
        async def f(self, request_id):
            if _marked(request_id, "log"):
                raise InjectedFault("log")
            return await orig(self, request_id)
        return f

    def render(orig):
        async def f(self, prompt):
            if "fault-render" in repr(prompt):
                raise InjectedFault("render")
            return await orig(self, prompt)
        return f

    def write(orig):
        async def f(self, request_id, record):
            if _marked(request_id, "claim") and isinstance(record, Claim):
                raise InjectedFault("claim")
            return await orig(self, request_id, record)
        return f

    def accepted(orig):
        async def f(self, *args, **kw):
            if _marked(self.request_id, "accepted"):
                raise InjectedFault("accepted")
            return await orig(self, *args, **kw)
        return f

    def generate(orig):
        def f(self, req, *args, **kw):
            if _marked(req.request_id, "engine"):
                async def boom():
                    raise InjectedFault("engine")
                    yield  # an async generator, like the engine's
                return boom()
            return orig(self, req, *args, **kw)
        return f

    def tokens(orig):
        async def f(self, *args, **kw):
            if _marked(self.request_id, "tokens"):
                raise InjectedFault("tokens")
            return await orig(self, *args, **kw)
        return f

    def store_result(orig):
        async def f(self, request_id, result: Result):
            if _marked(request_id, "result") and result.final is not None:
                raise InjectedFault("result")
            return await orig(self, request_id, result)
        return f

    def send(orig):
        async def f(self, frame):
            if _marked(self.request_id, "final") and isinstance(frame, FinalFrame):
                raise InjectedFault("final")
            return await orig(self, frame)
        return f

    def publish(orig):
        async def f(self, rec: TraceRecord):
            if _marked(rec.request_id, "trace"):
                raise InjectedFault("trace")
            return await orig(self, rec)
        return f

    def compact(orig):
        async def f(self, request_id):
            if _marked(request_id, "compact"):
                raise InjectedFault("compact")
            return await orig(self, request_id)
        return f

    return [
        (jobrun, "decode_request", decode), (RequestLog, "last", last), (engine_cls, "render", render),
        (RequestLog, "write", write), (FrameSink, "accepted", accepted), (engine_cls, "generate", generate),
        (FrameSink, "tokens", tokens), (RequestLog, "store_result", store_result), (FrameSink, "send", send),
        (TracePublisher, "publish", publish), (RequestLog, "compact", compact),
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
