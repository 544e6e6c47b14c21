"""The repair of a prompt that ends inside a character (workers/engine/prompttail.py): the prompt's
text vLLM's detokenizer puts before the generated text is dropped, and stop strings apply the way
vLLM applies them."""

from __future__ import annotations

import random

import pytest

from jetllm.workers.engine.base import ChoiceDelta, EngineStep
from jetllm.workers.engine.prompttail import TailChoices, TailText, leaked_text

# (leaked, stop, include, min_tokens, deltas as (tokens, text, finished), emitted, stopped)
CASES = [
    ("", [], False, 0, [(1, "ab", False), (1, "c", True)], ["ab", "c"], None),
    (
        "user: hi",
        [],
        False,
        0,
        [(1, "user:", False), (1, " hiX", False), (1, "Y", True)],
        ["", "X", "Y"],
        None,
    ),
    ("user: hi", [], False, 0, [(2, "user: hiXY", True)], ["XY"], None),
    ("", ["ZZ"], False, 0, [(1, "aZ", False), (1, "Zb", False)], ["a", ""], "ZZ"),
    ("", ["ZZ"], True, 0, [(1, "aZ", False), (1, "Zb", False)], ["aZ", "Z"], "ZZ"),
    ("", ["ZZ"], False, 0, [(1, "aZ", False), (1, "b", True)], ["a", "Zb"], None),
    ("pZZ", ["ZZ"], False, 0, [(1, "pZZq", False), (1, "r", True)], ["", "qr"], None),
    ("", ["q"], False, 2, [(1, "q", False), (1, "q", False), (1, "q", False)], ["q", "q", ""], "q"),
    ("", ["bc", "ab"], False, 0, [(1, "xabc", False)], ["x"], "ab"),
    (
        "",
        ["end"],
        False,
        0,
        [(1, "the en", False), (1, "d", False), (1, "more", True)],
        ["the ", "", ""],
        "end",
    ),
    ("abc", [], False, 0, [(1, "xyz", False)], ["xyz"], None),
]


@pytest.mark.parametrize("leaked,stop,include,min_tokens,deltas,emitted,stopped", CASES)
def test_tail_text(leaked, stop, include, min_tokens, deltas, emitted, stopped):
    tail = TailText(leaked, stop, include, min_tokens)
    assert [tail.take(n, text, fin) for n, text, fin in deltas] == emitted
    assert tail.stopped == stopped


def test_a_choice_ended_by_a_stop_string_ends_and_the_request_ends_with_its_last_choice():
    tails = TailChoices("P", 2, ["!"], False, 0, want_text=True)

    def step(*choices):
        return EngineStep(
            choices=[ChoiceDelta(index=i, token_ids=[7], text=t) for i, t in choices], finished=False
        )

    first = tails.repair(step((0, "Pa!"), (1, "Pb")))
    assert [(c.text, c.finish_reason, c.stop_reason) for c in first.choices] == [
        ("a", "stop", "!"),
        ("b", None, None),
    ]
    assert not first.finished and not tails.done
    second = tails.repair(step((0, "ignored"), (1, "c!")))
    assert [(c.index, c.text, c.stop_reason) for c in second.choices] == [(1, "c", "!")]
    assert second.finished and tails.done


def test_text_is_dropped_when_only_stop_strings_needed_it():
    tails = TailChoices("P", 1, ["!"], False, 0, want_text=False)
    out = tails.repair(EngineStep(choices=[ChoiceDelta(index=0, token_ids=[1], text="Px!")], finished=False))
    (c,) = out.choices
    assert c.text is None and c.stop_reason == "!" and out.finished


CHARS = {1: "a", 2: "!", 3: "b", 4: "c", 5: "?"}
HALVES = (6, 7)
"""Two tokens that are the two bytes of one character, "é"."""


def text_of(ids):
    """As a tokenizer decodes: a character's first byte alone is U+FFFD."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == HALVES[0]:
            whole = ids[i + 1 : i + 2] == [HALVES[1]]
            out.append("é" if whole else "\ufffd")
            i += 2 if whole else 1
        else:
            out.append(CHARS[ids[i]])
            i += 1
    return "".join(out)


@pytest.mark.parametrize(
    ("include", "min_tokens", "steps", "kept", "text"),
    [
        (False, 0, [[1, 2, 3, 4]], [[1, 2]], "a"),  # vLLM merged four outputs: cut after the "!"
        (True, 0, [[1, 2, 3, 4]], [[1, 2]], "a!"),
        (False, 0, [[1], [3, 2, 4]], [[1], [3, 2]], "ab"),  # tokens of earlier steps count
        (False, 2, [[2, 1, 2, 3]], [[2, 1, 2]], "!a"),  # not before min_tokens, as in vLLM
        (False, 0, [[1, 3, 4]], [[1, 3, 4]], "abc"),  # no stop: every token stays
        (False, 0, [[1, 6, 7, 2, 3]], [[1, 6, 7, 2]], "aé"),  # a character in two tokens (CI)
        (False, 0, [[1, 6], [7, 2, 3]], [[1, 6], [7, 2]], "aé"),
    ],
)
def test_a_step_of_several_tokens_keeps_those_up_to_the_stop_string(include, min_tokens, steps, kept, text):
    tails = TailChoices("Pq", 1, ["!"], include, min_tokens, want_text=True, text_of=text_of)
    out: list = []
    seen: list[int] = []
    for n, ids in enumerate(steps):
        leak = "Pq" if n == 0 else ""  # vLLM's first text carries the prompt's
        # vLLM's delta: the text that became whole with this step's tokens
        new = text_of(seen + ids).rstrip("\ufffd")[len(text_of(seen).rstrip("\ufffd")) :]
        seen += ids
        step = EngineStep(
            choices=[ChoiceDelta(index=0, token_ids=ids, text=leak + new, logprobs=[-1.0] * len(ids))],
            finished=False,
        )
        out.extend(tails.repair(step).choices)
    assert [c.token_ids for c in out] == kept
    assert all(len(c.logprobs) == len(c.token_ids) for c in out)
    assert "".join(c.text or "" for c in out) == text


def _tokenizer(tiny_model):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_the_leak_is_what_the_installed_detokenizer_emits(tiny_model):
    """The assumption prompttail rests on, checked against the installed `tokenizers`: a
    DecodeStream primed with prompt + delivered tokens emits, when that prompt ends inside a
    character, exactly `leaked_text` before the text a stream that saw the whole generation
    emits for the rest; and nothing extra otherwise."""
    from tokenizers.decoders import DecodeStream

    tok = _tokenizer(tiny_model)
    vocab = tok.get_vocab_size()

    def decode(ids):
        return tok.decode(list(ids), skip_special_tokens=True)

    def texts(stream, ids):
        return [stream.step(tok, i) or "" for i in ids]

    rng = random.Random(7)
    prompt = tok.encode("user: write a short poem about the sea. assistant:", add_special_tokens=False).ids
    leaks = 0
    for _ in range(300):
        gen = [rng.randrange(3, vocab) for _ in range(40)]
        k = rng.randrange(1, 39)
        whole = texts(DecodeStream(ids=prompt, skip_special_tokens=True), gen)
        continued = "".join(texts(DecodeStream(ids=prompt + gen[:k], skip_special_tokens=True), gen[k:]))
        leaked = leaked_text(decode, prompt + gen[:k])
        tail = TailText(leaked or "", [], False, 0)
        assert tail.take(40 - k, continued, True) == "".join(whole[k:])
        leaks += leaked is not None
    assert leaks > 30  # the random byte tokens of the tiny vocabulary end inside a character often
