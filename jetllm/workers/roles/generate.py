"""The aggregated role: a generate job runs prefill and decode on this worker's engine."""

from __future__ import annotations

from ...errors import RequestRejected
from ...schemas import Choice, ErrorCode, GenerateRequest, Usage
from ..engine import Engine
from ..frames import FrameSink


class GenerateRole:
    role = "generate"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def check_model(self, req: GenerateRequest) -> None:
        if req.model != self.engine.facts.model:
            raise RequestRejected(
                ErrorCode.MODEL_NOT_SERVED,
                f"this worker serves {self.engine.facts.model!r}, not {req.model!r}",
                field="$.model",
            )

    def max_tokens(self, req: GenerateRequest, prompt_len: int) -> int:
        limit = self.engine.facts.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise RequestRejected(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {prompt_len} tokens, but this model's maximum context length is "
                f"{limit} tokens (prompt plus at least one generated token)",
                field="$.prompt",
            )
        asked = req.stop.max_tokens
        if asked is None:
            return room
        if asked > room:
            raise RequestRejected(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"this model's maximum context length is {limit} tokens, but {prompt_len + asked} "
                f"were requested ({prompt_len} in the prompt, {asked} in max_tokens); lower "
                f"max_tokens to at most {room} or leave it unset",
                field="$.stop.max_tokens",
            )
        return asked

    async def run(self, req: GenerateRequest, frames: FrameSink) -> None:
        """Stream the request's tokens and its final frame; raises on rejection or engine failure."""
        self.check_model(req)
        prompt_ids = await self.engine.render(req.prompt)
        max_tokens = self.max_tokens(req, len(prompt_ids))
        counts = [0] * req.sampling.n
        ends: dict[int, Choice] = {}
        cached = 0
        async for step in self.engine.generate(req, prompt_ids, max_tokens):
            cached = step.cached_tokens or cached
            for c in step.choices:
                if c.token_ids or c.text:
                    counts[c.index] += len(c.token_ids)
                    await frames.tokens(c.index, c.token_ids, c.text, c.logprobs, c.top_logprobs)
                if c.finish_reason is not None:
                    ends[c.index] = Choice(
                        index=c.index,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        completion_tokens=counts[c.index],
                    )
        choices = [
            ends.get(i) or Choice(index=i, finish_reason="stop", completion_tokens=counts[i])
            for i in range(req.sampling.n)
        ]
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=sum(counts), cached_tokens=cached)
        await frames.final(choices, usage)
