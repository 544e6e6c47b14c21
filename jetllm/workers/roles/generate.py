"""The aggregated role: a generate job runs prefill and decode on this worker's engine."""

from __future__ import annotations

import msgspec

from ...errors import RequestRejected
from ...schemas import Choice, ErrorCode, GenerateRequest, Usage
from ..engine import Engine, EngineAdapter, EnginePrompt, PromptEmbeds
from ..frames import FrameSink
from ..requestlog import History


class Outcome(msgspec.Struct, kw_only=True):
    choices: list[Choice]
    usage: Usage
    token_ids: list[list[int]]
    text: list[str] | None


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

    def _already_done(self, req: GenerateRequest, delivered: list[int], text: str | None, max_tokens: int) -> Choice | None:
        """Whether the delivered tokens already ended the request (the worker died before the final)."""
        n = len(delivered)
        if n >= max_tokens:
            return Choice(index=0, finish_reason="length", completion_tokens=n)
        if n < req.stop.min_tokens or not delivered:
            return None
        last = delivered[-1]
        if last in req.stop.stop_token_ids:
            return Choice(index=0, finish_reason="stop", stop_reason=last, completion_tokens=n)
        if last in self.engine.facts.eos_token_ids and not req.stop.ignore_eos:
            return Choice(index=0, finish_reason="stop", completion_tokens=n)
        for s in req.stop.stop:
            if text is not None and s in text:
                return Choice(index=0, finish_reason="stop", stop_reason=s, completion_tokens=n)
        return None

    async def run(
        self, req: GenerateRequest, frames: FrameSink, prompt_ids: EnginePrompt, history: History,
        adapter: EngineAdapter | None = None,
    ) -> Outcome:
        """Generate (or continue) the request, streaming token frames; the caller sends the final.

        A continuation runs the prompt plus the tokens already delivered as the new prompt, with
        the budget reduced by what was delivered, so the producer's stream goes on seamlessly
        (an embeddings prompt continues in vLLM's mixed mode: its rows, then the token ids).
        """
        self.check_model(req)
        n = req.sampling.n
        max_tokens = self.max_tokens(req, len(prompt_ids))
        tokens = history.tokens(n)
        texts = history.texts(n)
        counts = [len(t) for t in tokens]
        ends: dict[int, Choice] = {}
        cached = 0
        delivered = sum(counts)
        if delivered and n > 1:
            raise RequestRejected(
                ErrorCode.NOT_MIGRATABLE,
                f"a worker died after delivering {delivered} tokens of an n={n} request; its choices "
                "cannot continue on another worker without changing delivered tokens",
                field="$.sampling.n",
            )
        engine_req, engine_prompt, engine_max = req, prompt_ids, max_tokens
        if delivered:
            done = self._already_done(req, tokens[0], texts[0] if texts else None, max_tokens)
            if done is not None:
                ends[0] = done
            else:
                engine_prompt = (
                    prompt_ids.then(tokens[0]) if isinstance(prompt_ids, PromptEmbeds) else prompt_ids + tokens[0]
                )
                engine_max = max_tokens - delivered
                engine_req = msgspec.structs.replace(
                    req, stop=msgspec.structs.replace(
                        req.stop, max_tokens=engine_max, min_tokens=max(0, req.stop.min_tokens - delivered)
                    ),
                )
        if not ends:
            async for step in self.engine.generate(engine_req, engine_prompt, engine_max, adapter):
                cached = step.cached_tokens or cached
                for c in step.choices:
                    if c.token_ids or c.text:
                        counts[c.index] += len(c.token_ids)
                        tokens[c.index].extend(c.token_ids)
                        if c.text is not None:
                            if texts is None:
                                texts = ["" for _ in range(n)]
                            texts[c.index] += c.text
                        await frames.tokens(c.index, c.token_ids, c.text, c.logprobs, c.top_logprobs)
                    if c.finish_reason is not None:
                        ends[c.index] = Choice(
                            index=c.index,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            completion_tokens=counts[c.index],
                        )
        choices = [
            ends.get(i) or Choice(index=i, finish_reason="stop", completion_tokens=counts[i]) for i in range(n)
        ]
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=sum(counts), cached_tokens=cached)
        return Outcome(choices=choices, usage=usage, token_ids=tokens, text=texts)
