"""Where a job goes, as a table: the cost of each candidate, ties and missing data to the shared queue."""

from __future__ import annotations

import random

import pytest

from jetllm.router.cost import Candidate, Weights, by_load, cached_tokens, choose, cost, shortlist

W = Weights()


def c(inst: str, cached: int = 0, running: int = 0, waiting: int = 0, slots: int = 8, kv=None) -> Candidate:
    return Candidate(inst, cached, running, waiting, slots, kv)


CASES = [
    # (name, prompt tokens, candidates, session, chosen, why starts with)
    ("nothing live", 100, [], None, None, "no live instance"),
    ("nothing cached anywhere", 100, [c("a"), c("b", running=3)], None, None, "no cached prefix"),
    ("the holder of the prefix", 1000, [c("a", cached=512), c("b")], None, "a", "512/1000"),
    ("the longer prefix", 1000, [c("a", cached=256), c("b", cached=768)], None, "b", "768/1000"),
    (
        "a busy holder loses to an idle cold one",
        600,
        [c("a", cached=64, running=8, waiting=8), c("b")],
        None,
        "b",
        "0/600",
    ),
    (
        "a busy holder of a long prefix still wins",
        4000,
        [c("a", cached=3000, running=8, waiting=8), c("b")],
        None,
        "a",
        "3000/4000",
    ),
    (
        "a full cache weighs",
        1000,
        [c("a", cached=64, kv=1.0), c("b", cached=64, kv=0.0)],
        None,
        "b",
        "64/1000",
    ),
    ("two equal holders tie", 1000, [c("a", cached=512), c("b", cached=512)], None, None, "tie between"),
    (
        "holders tie and another instance costs more: the lowest id of the holders",
        1000,
        [c("b", cached=512), c("c", cached=512), c("z"), c("a", cached=512, running=1)],
        None,
        "b",
        "512/1000 prompt tokens cached, load 0+0/8: lowest cost 488, tied with 1 other holder(s)",
    ),
    (
        "a holder ties with an instance holding nothing",
        1000,
        [c("a", cached=512, running=8), c("z"), c("y", running=4)],
        None,
        None,
        "tie between",
    ),
    (
        "no load data for the best",
        1000,
        [c("a", cached=512, slots=0), c("b")],
        None,
        None,
        "no load data for a",
    ),
    ("session affinity without events", 100, [c("a"), c("b")], "b", "b", "session affinity"),
    ("a session whose instance is gone", 100, [c("a"), c("b", running=2)], "z", "a", "session start"),
    ("a cached prefix beats the session", 1000, [c("a", cached=512), c("b")], "b", "a", "512/1000"),
]


@pytest.mark.parametrize("name,prompt,cands,session,chosen,why", CASES, ids=[x[0] for x in CASES])
def test_choose(name, prompt, cands, session, chosen, why):
    choice = choose(prompt, cands, W, session=session, new_session=session is not None)
    assert choice.instance == chosen
    assert choice.why.startswith(why), choice.why
    assert [s.cost for s in choice.scored] == sorted(s.cost for s in choice.scored)


@pytest.mark.parametrize(
    "cand,prompt,expected",
    [
        (c("a"), 100, 100.0),
        (c("a", cached=64), 100, 36.0),
        (c("a", cached=64, running=4, waiting=4), 100, 36.0 + 512.0),
        (c("a", kv=0.5), 10, 10.0 + 64.0),
        (c("a", running=3, slots=0), 10, 10.0),  # no slots known: no load term
    ],
)
def test_cost(cand, prompt, expected):
    assert cost(cand, prompt, W) == expected


def test_a_new_session_starts_on_the_least_loaded_instance():
    cands = [c("a", running=4), c("b", running=1), c("c", slots=0)]
    assert choose(100, cands, W).instance is None
    assert choose(100, cands, W, new_session=True).instance == "b"
    assert choose(100, [c("a", slots=0)], W, new_session=True).instance is None


def test_weights_are_tunable():
    cands = [c("a", cached=64, running=8), c("b")]
    assert choose(600, cands, W).instance == "b"
    assert choose(600, cands, Weights(queue=0.0, kv=0.0)).instance == "a"
    assert choose(600, [c("a", cached=16), c("b")], Weights(min_cached=32)).instance is None


@pytest.mark.parametrize(
    "blocks,size,prompt,expected",
    [(0, 16, 100, 0), (2, 16, 100, 32), (7, 16, 100, 96), (7, 16, 112, 96), (7, 16, 113, 112), (3, 16, 0, 0)],
)
def test_cached_tokens_leave_the_last_prompt_token_to_compute(blocks, size, prompt, expected):
    assert cached_tokens(blocks, size, prompt) == expected


def test_the_shortlist_decides_as_the_whole_fleet_would():
    rnd = random.Random(1)
    for _ in range(300):
        fleet = [
            c(
                f"w{i}",
                0,
                rnd.randint(0, 8),
                rnd.randint(0, 4),
                rnd.choice([0, 8, 16]),
                rnd.choice([None, rnd.random()]),
            )
            for i in range(40)
        ]
        cached = {f"w{i}": rnd.choice([16, 64, 512]) for i in rnd.sample(range(40), rnd.randint(0, 5))}
        ranked = by_load(fleet, W)
        position = {x.instance: i for i, x in enumerate(ranked)}
        whole = [x._replace(cached_tokens=cached.get(x.instance, 0)) for x in fleet]
        prompt = rnd.choice([100, 600, 2000])
        short = choose(prompt, shortlist(ranked, cached, position), W, cached=cached)
        full = choose(prompt, whole, W)
        assert short.instance == full.instance
        assert [x.cost for x in short.scored] == [x.cost for x in full.scored]


@pytest.mark.parametrize(
    "name,cands,chosen,why",
    [
        ("the least loaded", [c("a", running=3), c("b", running=1), c("c", running=2)], "b", "prompt's home"),
        (
            "no load data anywhere: the shared queue",
            [c("a", slots=0), c("b", slots=0)],
            None,
            "no cached prefix",
        ),
        (
            "no load data for the least loaded: the shared queue",
            [c("a", slots=0), c("b", running=7)],
            None,
            "no cached prefix",
        ),
    ],
)
def test_a_prompt_no_instance_holds_goes_to_its_home(name, cands, chosen, why):
    choice = choose(100, cands, W, home_key=12345)
    assert choice.instance == chosen
    assert choice.why.startswith(why), choice.why


def test_equally_loaded_instances_give_each_prompt_one_home_whatever_their_order():
    idle = [c(f"w{i}") for i in range(5)]
    homes = []
    for key in range(200):
        home = choose(100, idle, W, home_key=key).instance
        assert all(
            choose(100, random.Random(key).sample(idle, 5), W, home_key=key).instance == home
            for _ in range(3)
        )
        homes.append(home)
    assert min(homes.count(x.instance) for x in idle) > 20  # prompts spread over the fleet


def test_of_equally_loaded_instances_a_home_goes_to_the_one_sent_fewest_jobs_lately():
    idle = [c("a"), c("b"), c("z")]
    lately = {"a": 3.2, "b": 0.4, "z": 2.0}.__getitem__
    assert all(choose(100, idle, W, home_key=k, recent=lately).instance == "b" for k in range(50))
    busy = [c("a"), c("b", running=4), c("z")]  # load first: b is not among the least loaded
    assert {choose(100, busy, W, home_key=k, recent=lately).instance for k in range(50)} == {"z"}
