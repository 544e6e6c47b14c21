"""The aggregated role's engine loop: one request generated (or continued) on this worker's engine,
every engine step sent as token frames. This is the token path: it does per step only what the
step needs (count, keep, send) and nothing per token beyond the engine's own work."""

from __future__ import annotations

from typing import Any

import msgspec

from ....schemas import Choice, ChoiceLogprobs, GenerateRequest, Usage
from ...engine import Engine, EngineAdapter, EnginePrompt
from ...requestlog import History, KeptLogprobs
from ..base import TokenSender
from .continuation import (
    Replay,
    already_done,
    check_delivered,
    check_migratable,
    continued,
    how_to_continue,
    max_tokens,
)


class Outcome(msgspec.Struct, kw_only=True):
    choices: list[Choice]
    usage: Usage
    token_ids: list[list[int]]
    text: list[str] | None
    logprobs: list[ChoiceLogprobs] | None = None


async def generate(
    engine: Engine,
    req: GenerateRequest,
    send: TokenSender,
    prompt_ids: EnginePrompt,
    history: History,
    adapter: EngineAdapter | None = None,
    kv_transfer: dict[str, Any] | None = None,
) -> Outcome:
    """Generate (or continue) the request, streaming token frames; the caller sends the final.

    A continuation runs the prompt plus the tokens already delivered as the new prompt, with
    the budget reduced by what was delivered, so the producer's stream goes on seamlessly; a
    structured one replays the original prompt and drops what was delivered (continuation.py).
    """
    facts = engine.facts
    n = req.sampling.n
    budget = max_tokens(req, len(prompt_ids), facts.max_model_len)
    tokens = history.tokens(n)
    texts = history.texts(n)
    kept = KeptLogprobs(history, n, req.output.logprobs is not None and req.reply_to is None)
    counts = [len(t) for t in tokens]
    ends: dict[int, Choice] = {}
    cached = 0
    delivered = sum(counts)
    check_migratable(n, delivered)
    engine_req, engine_prompt, engine_max = req, prompt_ids, budget
    replay: Replay | None = None
    if delivered:
        check_delivered(tokens[0], facts.vocab_size)
        done = already_done(req, tokens[0], texts[0] if texts else None, budget, facts.eos_token_ids)
        how = how_to_continue(req, done)
        if done is not None:
            ends[0] = done
        elif how == "replay":
            replay = Replay(list(tokens[0]), texts[0] if texts else None)
        else:
            engine_req, engine_prompt, engine_max = continued(req, prompt_ids, tokens[0], budget)
    if not ends:
        async for step in engine.generate(engine_req, engine_prompt, engine_max, adapter, kv_transfer):
            cached = step.cached_tokens or cached
            for c in step.choices:
                token_ids, text, logprobs, top = c.token_ids, c.text, c.logprobs, c.top_logprobs
                if replay is not None and not replay.done:  # only choice 0: n > 1 does not move
                    token_ids, text, logprobs, top = replay.take(token_ids, text, logprobs, top)
                    if c.finish_reason is not None:
                        replay.finished()
                if token_ids or text:
                    counts[c.index] += len(token_ids)
                    tokens[c.index].extend(token_ids)
                    kept.add(c.index, token_ids, logprobs, top, texts)
                    if text is not None:
                        if texts is None:
                            texts = ["" for _ in range(n)]
                        texts[c.index] += text
                    await send(c.index, token_ids, text, logprobs, top)
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
    return Outcome(choices=choices, usage=usage, token_ids=tokens, text=texts, logprobs=kept.choices)
