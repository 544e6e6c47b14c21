"""Continuing a request another worker started: pure decisions over what its log says.

A worker that died left token frames in the request's log. The next attempt runs the prompt plus
the tokens already delivered as its prompt, with the budget reduced by what was delivered, so the
producer's stream goes on seamlessly; unless the delivered tokens already ended the request (the
worker died before its final frame), the request cannot continue exactly (n > 1), or workers died
under it more often than its migration budget allows.

A structured request cannot take that path: the engine starts a constraint's grammar at the first
generated token, so delivered tokens moved into the prompt would be outside it, and the rest would
have to be a whole document again. It is replayed instead: the original prompt runs again under
the constraint, and the first tokens, checked against the delivered ones, are dropped (Replay).
Greedy and seeded requests regenerate the same tokens; an unseeded one samples with a seed derived
from its request id on every attempt (engine/structured.py), so it does too. Should the engine
still produce other tokens, the request ends with `not_migratable` rather than a stream that
breaks its constraint.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ....errors import RequestRejected
from ....schemas import Choice, ErrorCode, GenerateRequest
from ...engine import EnginePrompt, PromptEmbeds
from ...requestlog import History


def check_budget(history: History, budget: int, attempt: int) -> None:
    if history.deaths > budget:
        raise RequestRejected(
            ErrorCode.MIGRATION_BUDGET_EXHAUSTED,
            f"workers died under this request {history.deaths} times; its migration budget is "
            f"{budget} (delivery {attempt})",
        )


def max_tokens(req: GenerateRequest, prompt_len: int, limit: int) -> int:
    """The request's token budget: what it asked for, or the rest of the model's context."""
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


def check_migratable(n: int, delivered: int) -> None:
    if delivered and n > 1:
        raise RequestRejected(
            ErrorCode.NOT_MIGRATABLE,
            f"a worker died after delivering {delivered} tokens of an n={n} request; its choices "
            "cannot continue on another worker without changing delivered tokens",
            field="$.sampling.n",
        )


def check_delivered(delivered: list[int], vocab_size: int | None) -> None:
    """The log is shared state, so its tokens are checked before the engine sees them: an id the
    model cannot have produced means the record is not this request's (forged or corrupt), and
    vLLM does not check the token positions of a mixed embeddings prompt (it would crash)."""
    if not vocab_size:
        return
    bad = next((t for t in delivered if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected(
            ErrorCode.NOT_MIGRATABLE,
            f"the request's log says token {bad} was delivered, which this model (vocabulary "
            f"{vocab_size}) cannot have produced; the record is not trustworthy, so the request "
            "cannot continue from it",
        )


def already_done(
    req: GenerateRequest, delivered: list[int], text: str | None, max_tokens: int, eos_token_ids: list[int]
) -> Choice | None:
    """Whether the delivered tokens already ended the request (the worker died before the final)."""
    n = len(delivered)
    if n >= max_tokens:
        return Choice(index=0, finish_reason="length", completion_tokens=n)
    if n < req.stop.min_tokens or not delivered:
        return None
    last = delivered[-1]
    if last in req.stop.stop_token_ids:
        return Choice(index=0, finish_reason="stop", stop_reason=last, completion_tokens=n)
    if last in eos_token_ids and not req.stop.ignore_eos:
        return Choice(index=0, finish_reason="stop", completion_tokens=n)
    for s in req.stop.stop:
        if text is not None and s in text:
            return Choice(index=0, finish_reason="stop", stop_reason=s, completion_tokens=n)
    return None


def continued(
    req: GenerateRequest, prompt: EnginePrompt, delivered: list[int], max_tokens: int
) -> tuple[GenerateRequest, EnginePrompt, int]:
    """The request, prompt and budget the engine runs to continue after `delivered` tokens (an
    embeddings prompt continues in vLLM's mixed mode: its rows, then the token ids)."""
    engine_prompt = prompt.then(delivered) if isinstance(prompt, PromptEmbeds) else prompt + delivered
    engine_max = max_tokens - len(delivered)
    engine_req = msgspec.structs.replace(
        req,
        stop=msgspec.structs.replace(
            req.stop, max_tokens=engine_max, min_tokens=max(0, req.stop.min_tokens - len(delivered))
        ),
    )
    return engine_req, engine_prompt, engine_max


def how_to_continue(req: GenerateRequest, done: Choice | None) -> Literal["done", "prompt", "replay"]:
    """After delivered tokens: already ended, continue with them as the prompt, or replay them."""
    if done is not None:
        return "done"
    return "replay" if req.structured is not None else "prompt"


class Replay:
    """Drops the first tokens a replayed request generates, after checking they are the delivered
    ones; what `take` returns is the new part of each engine delta (often empty while replaying)."""

    def __init__(self, delivered: list[int], text: str | None) -> None:
        self._tokens = delivered
        self._text = text or ""
        self._seen = 0
        self._seen_text = ""

    @property
    def done(self) -> bool:
        return self._seen >= len(self._tokens) and len(self._seen_text) >= len(self._text)

    def take(
        self,
        token_ids: list[int],
        text: str | None,
        logprobs: list[float] | None = None,
        top: list[dict[int, float]] | None = None,
    ) -> tuple[list[int], str | None, list[float] | None, list[dict[int, float]] | None]:
        k = min(len(token_ids), len(self._tokens) - self._seen)
        if token_ids[:k] != self._tokens[self._seen : self._seen + k]:
            at = self._seen + next(i for i in range(k) if token_ids[i] != self._tokens[self._seen + i])
            raise self._differs(
                f"token {at} is {token_ids[at - self._seen]}, not the delivered {self._tokens[at]}"
            )
        self._seen += k
        if text is not None:
            j = max(0, min(len(text), len(self._text) - len(self._seen_text)))
            self._seen_text += text[:j]
            if not self._text.startswith(self._seen_text):
                raise self._differs(
                    f"its text departs from the delivered text at character {len(self._seen_text)}"
                )
            text = text[j:]
        return (
            token_ids[k:],
            text,
            logprobs[k:] if logprobs is not None else None,
            top[k:] if top is not None else None,
        )

    def finished(self) -> None:
        """The engine ended the choice: it must have regenerated everything delivered."""
        if not self.done:
            raise self._differs(f"it ended after {self._seen} of the {len(self._tokens)} delivered tokens")

    def _differs(self, what: str) -> RequestRejected:
        return RequestRejected(
            ErrorCode.NOT_MIGRATABLE,
            f"this structured request moved to another worker, which replays it under its constraint, "
            f"and the replay differs from what was delivered: {what}; the request ends here so that "
            "its output never breaks the constraint (greedy and seeded requests replay exactly unless "
            "the engine's numerics changed: run it again)",
            field="$.structured",
        )
