"""Text for a prompt that ends inside a character, which vLLM's fast detokenizer gets wrong.

vLLM primes its detokenizer with the prompt's tokens. When they decode to an unfinished
character (a byte token holding part of one: emoji, CJK, any random model's output), the first
text it emits holds the whole prompt's text before the generated text (vLLM issue 48853), and its
stop strings are matched against that prompt text too. A continued request meets this whenever a
worker died between the bytes of one character, so a migrated stream would repeat its prompt.

For such a prompt the engine runs without stop strings, and `TailText` repairs each choice's
text: it drops the prompt's text, which the first deltas carry whole (the decoded prompt up to its
unfinished character), and applies the stop strings itself the way vLLM does: only after
`min_tokens`, the text cut at the first match (after it with `include_stop_str_in_output`), and
what could still become a stop string held back until the choice ends. A step can carry several
tokens (vLLM merges the outputs its reader has not taken yet): one that ends at a stop string
keeps only the tokens up to the one that completed it, as vLLM's own check after every token does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from .base import ChoiceDelta, EngineStep

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
_TAIL = 8


def leaked_text(decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int]) -> str | None:
    """The text vLLM's detokenizer will put before the generated text, or None when the prompt
    ends on a whole character (the common case, decided from its last tokens only)."""
    if not prompt_ids or not decode(prompt_ids[-_TAIL:]).endswith(REPLACEMENT):
        return None
    return decode(prompt_ids).rstrip(REPLACEMENT)


class TailText:
    """One choice's text, repaired; `take` returns what to emit and the stop string that ended it."""

    def __init__(self, leaked: str, stop: Sequence[str], include_stop: bool, min_tokens: int) -> None:
        self._leaked = leaked
        self._stop = list(stop)
        self._include = include_stop
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1 if not include_stop else 0
        self._text = ""
        self._sent = 0
        self._tokens = 0
        self.stopped: str | None = None

    def take(self, tokens: int, text: str, finished: bool) -> str:
        """The part of this step's text to emit; sets `stopped` when a stop string ends the choice."""
        if self.stopped is not None:
            return ""
        text = self._drop_leak(text)
        before = len(self._text)
        self._text += text
        self._tokens += tokens
        if self._stop and self._tokens > self._min_tokens:
            self._match(before)
        end = len(self._text) if finished or self.stopped is not None else len(self._text) - self._hold
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent : end], end
        return out

    def may_stop(self, text: str) -> bool:
        """Whether a stop string may end in `text` (the next raw text): a cheap test before the
        token-by-token split."""
        return any(s in self._text[-len(s) :] + text for s in self._stop)

    def _drop_leak(self, text: str) -> str:
        if not self._leaked:
            return text
        n = min(len(text), len(self._leaked))
        if text[:n] != self._leaked[:n]:
            log.warning("the engine's text did not start with its prompt's text; passing it on as it is")
            self._leaked = ""
            return text
        self._leaked = self._leaked[n:]
        return text[n:]

    def _match(self, before: int) -> None:
        found: tuple[int, str] | None = None
        for s in self._stop:
            at = self._text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, s)
        if found is not None:
            at, s = found
            self._text = self._text[: at + len(s) if self._include else at]
            self.stopped = s


class TailChoices:
    """The repair of every choice of one request; `repair` turns an engine step into what the
    engine would have said without the leak (`done` once every choice ended)."""

    def __init__(
        self,
        leaked: str,
        n: int,
        stop: Sequence[str],
        include_stop: bool,
        min_tokens: int,
        want_text: bool,
        text_of: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """`text_of`: the text of a choice's generated tokens (after the prompt, without its leak),
        to find which token of a several-token step completed a stop string."""
        self._tails = [TailText(leaked, stop, include_stop, min_tokens) for _ in range(n)]
        self._want_text = want_text
        self._text_of = text_of
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self._ended: set[int] = set()

    @property
    def done(self) -> bool:
        return len(self._ended) == len(self._tails)

    def repair(self, step: EngineStep) -> EngineStep:
        choices = []
        for c in step.choices:
            if c.index in self._ended:
                continue
            tail, before = self._tails[c.index], self._ids[c.index]
            finished = c.finish_reason is not None
            pieces = self._pieces(before, c.token_ids, c.text or "") if tail.may_stop(c.text or "") else None
            if pieces is None:
                text = tail.take(len(c.token_ids), c.text or "", finished)
            else:  # token by token, as vLLM checks its stop strings
                text = ""
                for keep, piece in enumerate(pieces, 1):
                    text += tail.take(1, piece, finished and keep == len(pieces))
                    if tail.stopped is not None:
                        c = _cut(c, keep)
                        break
            c = msgspec.structs.replace(c, text=text if self._want_text else None)
            if tail.stopped is not None:
                c = msgspec.structs.replace(c, finish_reason="stop", stop_reason=tail.stopped)
            before.extend(c.token_ids)
            if c.finish_reason is not None:
                self._ended.add(c.index)
            choices.append(c)
        return msgspec.structs.replace(step, choices=choices, finished=step.finished or self.done)

    def _pieces(self, before: list[int], ids: list[int], text: str) -> list[str] | None:
        """A several-token step's text split at its tokens (the first piece keeps what is left of
        the prompt's leaked text); None for a single token, or when the split does not add up."""
        if self._text_of is None or len(ids) < 2:
            return None
        # A token inside a character decodes to a trailing U+FFFD that the next token replaces:
        # until the character is whole it has no text, as in vLLM's detokenizer.
        texts = [self._text_of(before + ids[:k]).rstrip(REPLACEMENT) for k in range(len(ids) + 1)]
        if any(not b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)):
            return None
        pieces = [b[len(a) :] for a, b in zip(texts, texts[1:], strict=False)]
        new = texts[-1][len(texts[0]) :]
        if not text.endswith(new):
            return None
        pieces[0] = text[: len(text) - len(new)] + pieces[0]
        return pieces


def _cut(c: ChoiceDelta, keep: int) -> ChoiceDelta:
    return msgspec.structs.replace(
        c,
        token_ids=c.token_ids[:keep],
        logprobs=None if c.logprobs is None else c.logprobs[:keep],
        top_logprobs=None if c.top_logprobs is None else c.top_logprobs[:keep],
    )
