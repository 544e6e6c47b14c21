"""`POST /v1/completions`: one job per prompt, run at once; choice `i` of prompt `p` is `p * n + i`."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..openai.bodies import CompletionRequest
from ..openai.endpoints import COMPLETIONS, response_id
from ..openai.errors import OpenAIError
from ..openai.responses import Collected, add_usage
from ..openai.streams import CompletionStream
from ..openai.translate import completion_jobs
from ..schemas import FinalFrame, TokensFrame, Usage
from .service import Gateway, answer, created, refused
from .sse import Emit, EventStream

ENDPOINT = "completions"


async def completions(request: Request) -> Response | EventStream:
    gw: Gateway = request.app.state.gateway
    arrived = time.monotonic()
    try:
        body: CompletionRequest = await gw.parse(request, CompletionRequest)
        route = await gw.route(body.model)
        rid = response_id(COMPLETIONS, uuid.uuid4().hex)
        jobs = completion_jobs(body, route, rid)
        await gw.admit(route, len(jobs))
    except OpenAIError as err:
        return refused(gw, ENDPOINT, err)
    when, n = created(), body.n
    first: list[float] = []

    def first_token() -> None:
        if not first:
            first.append(time.monotonic())
            gw.metrics.ttft.labels(ENDPOINT).observe(first[0] - arrived)

    async def whole() -> dict[str, Any]:
        collected = Collected(n * len(jobs), body.logprobs is not None)

        async def on_frame(p: int, frame: TokensFrame | FinalFrame) -> None:
            if isinstance(frame, TokensFrame):
                first_token()
                collected.tokens(frame, p * n)
            else:
                collected.final(frame, p * n)

        await gw.run(jobs, on_frame)
        return collected.completion(rid, when, body.model, token_ids=body.return_token_ids)

    async def stream(emit: Emit) -> None:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = CompletionStream(
            rid, when, body.model, include_usage=include_usage, token_ids=body.return_token_ids
        )
        total: list[Usage] = []

        async def on_frame(p: int, frame: TokensFrame | FinalFrame) -> None:
            if isinstance(frame, TokensFrame):
                first_token()
                out = chunks.tokens(frame, p * n)
            else:
                total[:] = [add_usage(total[0] if total else None, frame.usage)]
                out = chunks.final(frame, p * n)
            await emit(*out)

        await gw.run(jobs, on_frame)
        if include_usage and total:
            await emit(chunks.usage_chunk(total[0]))

    return await answer(gw, request, ENDPOINT, whole, stream if body.stream else None)


routes = [Route(COMPLETIONS, completions, methods=["POST"])]
