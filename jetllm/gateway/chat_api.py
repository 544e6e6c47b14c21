"""`POST /v1/chat/completions`."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..openai.bodies import ChatRequest
from ..openai.endpoints import CHAT, response_id
from ..openai.errors import OpenAIError
from ..openai.responses import Collected
from ..openai.streams import ChatStream
from ..openai.translate import chat_job
from ..schemas import FinalFrame, TokensFrame, Usage
from .service import Gateway, answer, created, refused
from .sse import Emit, EventStream

ENDPOINT = "chat"


async def chat_completions(request: Request) -> Response | EventStream:
    gw: Gateway = request.app.state.gateway
    arrived = time.monotonic()
    try:
        body: ChatRequest = await gw.parse(request, ChatRequest)
        route = await gw.route(body.model)
        job = chat_job(body, route, response_id(CHAT, uuid.uuid4().hex))
        await gw.admit(route)
    except OpenAIError as err:
        return refused(gw, ENDPOINT, err)
    rid, when, n = job.request.request_id, created(), job.request.sampling.n
    first: list[float] = []

    def first_token() -> None:
        if not first:
            first.append(time.monotonic())
            gw.metrics.ttft.labels(ENDPOINT).observe(first[0] - arrived)

    async def whole() -> dict[str, Any]:
        collected = Collected(n, job.request.output.logprobs is not None)

        async def on_frame(_: int, frame: TokensFrame | FinalFrame) -> None:
            if isinstance(frame, TokensFrame):
                first_token()
                collected.tokens(frame)
            else:
                collected.final(frame)

        await gw.run([job], on_frame)
        return collected.chat(rid, when, body.model, job.tool_plan)

    async def stream(emit: Emit) -> None:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = ChatStream(rid, when, body.model, n, job.tool_plan, include_usage=include_usage)
        final: list[Usage] = []

        async def on_frame(_: int, frame: TokensFrame | FinalFrame) -> None:
            if isinstance(frame, TokensFrame):
                first_token()
                out = chunks.tokens(frame)
            else:
                final.append(frame.usage)
                out = chunks.final(frame)
            await emit(*out)

        await gw.run([job], on_frame)
        if include_usage and final:
            await emit(chunks.usage_chunk(final[0]))

    return await answer(gw, request, ENDPOINT, whole, stream if body.stream else None)


routes = [Route(CHAT, chat_completions, methods=["POST"])]
