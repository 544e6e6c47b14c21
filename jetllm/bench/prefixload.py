"""The shared-prefix workload of `jetllm bench-routing` and the placements the benchmark computes
itself (round-robin, the oracle): pure and seeded, so every policy of a run gets the same requests.

Two kinds of prefix sharing, as in the issue: groups of requests that share one long prefix (a
system prompt, a document) and differ in a short suffix, and multi-turn sessions, whose next turn
is the previous turn's prompt, its answer and a few new tokens. A session's turns run one after
another (the next turn needs the answer); everything else runs `concurrency` at a time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

FIRST_ID = 4
"""Token ids from here on: the recipe's models keep 0-3 for special tokens."""


class Step(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    """What shares a prefix: `g<i>` a group, `s<i>` a session."""
    tokens: list[int]
    """A group request's whole prompt; a session turn's tokens after the previous turn's prompt and
    answer (the first turn's: its own long prefix and the first question)."""
    turn: int = 0


class PrefixWorkload(msgspec.Struct, frozen=True, kw_only=True):
    groups: int = 6
    per_group: int = 16
    """Requests per group."""
    prefix_len: int = 1024
    """Tokens of a group's shared prefix, and of a session's first prompt before its question."""
    suffix_len: int = 32
    """Tokens of a group request after the shared prefix (its own)."""
    sessions: int = 3
    turns: int = 8
    turn_len: int = 32
    """New tokens a session turn adds after the previous answer."""
    output_len: int = 16
    concurrency: int = 6
    seed: int = 0
    vocab: int = 512

    @property
    def requests(self) -> int:
        return self.groups * self.per_group + self.sessions * self.turns

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt (a session's last turn, or a group request)."""
        last_turn = self.prefix_len + self.turns * self.turn_len + (self.turns - 1) * self.output_len
        return max(self.prefix_len + self.suffix_len, last_turn if self.sessions else 0)

    @property
    def distinct_tokens(self) -> int:
        """Prompt tokens that differ across the workload: what caching all of it would hold."""
        group = self.prefix_len + self.per_group * self.suffix_len
        session = self.prefix_len + self.turns * (self.turn_len + self.output_len)
        return self.groups * group + self.sessions * session

    def scripts(self) -> list[list[Step]]:
        """What the benchmark runs: each script's steps one after another, the scripts in this order
        `concurrency` at a time. A group request is a script of one step, a session one of `turns`;
        the order is shuffled (seeded), so the requests of a group arrive spread out."""
        rng = random.Random(self.seed)

        def draw(n: int) -> list[int]:
            return [rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]

        scripts: list[list[Step]] = []
        for g in range(self.groups):
            prefix = draw(self.prefix_len)
            scripts += [
                [Step(key=f"g{g}", tokens=prefix + draw(self.suffix_len))] for _ in range(self.per_group)
            ]
        for s in range(self.sessions):
            first = draw(self.prefix_len)
            scripts.append(
                [
                    Step(key=f"s{s}", tokens=(first if t == 0 else []) + draw(self.turn_len), turn=t)
                    for t in range(self.turns)
                ]
            )
        rng.shuffle(scripts)
        return scripts

    def weights(self) -> dict[str, int]:
        """Requests per prefix key: what the oracle balances."""
        return {
            **{f"g{g}": self.per_group for g in range(self.groups)},
            **{f"s{s}": self.turns for s in range(self.sessions)},
        }


def next_prompt(previous: list[int], answer: Sequence[int], step: Step) -> list[int]:
    """The prompt of `step`: a group request's own; a session turn's after the previous turn's prompt
    and answer (empty for the first turn)."""
    if step.turn == 0:
        return list(step.tokens)
    return [*previous, *answer, *step.tokens]


class RoundRobin:
    """Directed jobs in turn, whatever they hold."""

    def __init__(self, workers: Sequence[str]) -> None:
        if not workers:
            raise ValueError("round-robin needs at least one worker")
        self.workers = list(workers)
        self._next = 0

    def place(self, key: str) -> str:
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        return worker


class Oracle:
    """Placement by exact knowledge of every cache: the benchmark placed every request itself, so
    it knows which worker holds which prefix. Each prefix key stays on the worker of its first
    request; a new key goes to the worker with the fewest requests expected from the keys it holds
    (`weights`), ties to the first listed. Nothing else runs on the workers meanwhile and their
    caches are sized for the keys they hold, so the known holder is the one whose cache has it."""

    def __init__(self, workers: Sequence[str], weights: dict[str, int]) -> None:
        if not workers:
            raise ValueError("the oracle needs at least one worker")
        self.workers = list(workers)
        self.weights = weights
        self.home: dict[str, str] = {}
        self.expected = dict.fromkeys(self.workers, 0)

    def place(self, key: str) -> str:
        worker = self.home.get(key)
        if worker is None:
            worker = min(self.workers, key=lambda w: (self.expected[w], self.workers.index(w)))
            self.home[key] = worker
            self.expected[worker] += self.weights.get(key, 1)
        return worker
