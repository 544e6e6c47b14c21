"""`jetllm bench-routing`'s pure parts: the shared-prefix workload, the placements the benchmark
computes itself (round-robin, the oracle), and the report's figures and ratios."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import msgspec
import pytest

from jetllm import tinymodel
from jetllm.bench.prefixload import FIRST_ID, Oracle, PrefixWorkload, RoundRobin, Step, next_prompt
from jetllm.bench.routing import kv_cache_bytes
from jetllm.bench.routingreport import Outcome, Ratios, ratio_lines, ratios, summarize
from jetllm.cli import parser

SMALL = PrefixWorkload(groups=3, per_group=4, prefix_len=64, suffix_len=8, sessions=2, turns=3, turn_len=5)


def prompts(work: PrefixWorkload) -> list[tuple[Step, list[int]]]:
    """Every request's prompt, each session's answers being `output_len` tokens of 1s."""
    out = []
    for steps in work.scripts():
        prompt: list[int] = []
        for step in steps:
            prompt = next_prompt(prompt, [1] * work.output_len if step.turn else [], step)
            out.append((step, prompt))
    return out


def test_the_workload_has_every_request_once_and_is_the_same_for_the_same_seed():
    scripts = SMALL.scripts()
    steps = [s for script in scripts for s in script]
    assert len(steps) == SMALL.requests == 3 * 4 + 2 * 3
    assert sorted(len(s) for s in scripts) == [1] * 12 + [3, 3]
    assert scripts == SMALL.scripts()
    assert msgspec.structs.replace(SMALL, seed=1).scripts() != scripts
    assert all(FIRST_ID <= t < SMALL.vocab for s in steps for t in s.tokens)


def test_a_groups_requests_share_exactly_the_prefix_and_arrive_spread_out():
    by_group: dict[str, list[list[int]]] = {}
    order = []
    for step, prompt in prompts(SMALL):
        if step.key.startswith("g"):
            by_group.setdefault(step.key, []).append(prompt)
            order.append(step.key)
    assert sorted(by_group) == ["g0", "g1", "g2"]
    for group in by_group.values():
        assert len(group) == 4 and all(len(p) == 64 + 8 for p in group)
        assert len({tuple(p[:64]) for p in group}) == 1
        assert len({tuple(p[64:]) for p in group}) == 4  # own suffixes
    heads = {tuple(g[0][:64]) for g in by_group.values()}
    assert len(heads) == 3  # groups do not share prefixes with each other
    assert order != sorted(order)  # shuffled, not group after group


def test_a_session_turn_extends_the_previous_prompt_and_answer():
    turns = [(step, prompt) for step, prompt in prompts(SMALL) if step.key == "s0"]
    assert [step.turn for step, _ in turns] == [0, 1, 2]
    (_, first), (_, second), (step3, third) = turns
    assert len(first) == 64 + 5
    assert second[: len(first)] == first and second[len(first) : len(first) + 16] == [1] * 16
    assert third[: len(second)] == second and third[-5:] == step3.tokens
    assert max(len(p) for _, p in prompts(SMALL)) == SMALL.longest_prompt == len(third)


@pytest.mark.parametrize(
    ("previous", "answer", "step", "expected"),
    [
        ([9, 9], [8], Step(key="g0", tokens=[1, 2]), [1, 2]),
        ([], [], Step(key="s0", tokens=[1, 2]), [1, 2]),
        ([5, 6], [7], Step(key="s0", tokens=[1], turn=1), [5, 6, 7, 1]),
    ],
)
def test_next_prompt(previous, answer, step, expected):
    assert next_prompt(previous, answer, step) == expected


def test_round_robin_takes_the_workers_in_turn():
    rr = RoundRobin(["a", "b", "c"])
    assert [rr.place(k) for k in ["g0", "g0", "g0", "s1", "g2"]] == ["a", "b", "c", "a", "b"]


@pytest.mark.parametrize(
    ("weights", "keys", "expected"),
    [
        # a key stays where it first went; new keys go to the worker expecting the fewest requests
        (
            {"g0": 4, "g1": 4, "g2": 4, "g3": 4},
            ["g0", "g1", "g0", "g2", "g3", "g1"],
            ["a", "b", "a", "c", "a", "b"],
        ),
        # a heavy key fills a worker: the next two go elsewhere
        ({"g0": 12, "s0": 3, "s1": 3, "s2": 3}, ["g0", "s0", "s1", "s2"], ["a", "b", "c", "b"]),
        # unknown keys weigh one request
        ({}, ["x", "y", "x", "z", "w"], ["a", "b", "a", "c", "a"]),
    ],
)
def test_the_oracle_keeps_each_prefix_on_one_worker_and_balances_the_rest(weights, keys, expected):
    oracle = Oracle(["a", "b", "c"], weights)
    assert [oracle.place(k) for k in keys] == expected


def test_placements_need_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        Oracle([], {})
    with pytest.raises(ValueError, match="at least one worker"):
        RoundRobin([])


def outcomes(ttfts: list[float], cached: int, worker_of=lambda i: "w1") -> list[Outcome]:
    return [
        Outcome(
            key="g0", ttft=t, prompt_tokens=100, cached_tokens=cached, output_tokens=10, worker=worker_of(i)
        )
        for i, t in enumerate(ttfts)
    ]


def test_a_row_counts_what_finished_and_ignores_failed_requests():
    done = outcomes([0.1 * i for i in range(1, 11)], 50, worker_of=lambda i: "w1" if i < 7 else "w2")
    failed = Outcome(key="g1", error="engine_error: boom", output_tokens=99, cached_tokens=999)
    row = summarize("kv", [*done, failed], seconds=4.0)
    assert (row.requests, row.errors) == (11, 1)
    assert row.tokens_per_s == 100 / 4.0
    assert (row.cached_tokens, row.prompt_tokens) == (500, 1000)
    assert row.per_worker == [7, 3]
    assert math.isclose(row.ttft_p50_ms, 550.0) and math.isclose(row.ttft_p90_ms, 910.0)
    assert (row.hits, row.miss_ttft_p50_ms) == (10, None)  # half the prompt cached counts as a hit


def test_a_row_tells_the_ttft_of_hits_from_misses():
    cold = outcomes([2.0, 3.0, 4.0], cached=49)
    warm = outcomes([0.1, 0.3], cached=96)
    row = summarize("shared", cold + warm, seconds=1.0)
    assert row.hits == 2
    assert math.isclose(row.hit_ttft_p50_ms, 200.0) and math.isclose(row.miss_ttft_p50_ms, 3000.0)


@pytest.mark.parametrize(
    ("policies", "expected"),
    [
        (
            {
                "shared": (900, 10.0, 300),
                "kv": (200, 12.0, 950),
                "oracle": (150, 13.0, 1000),
                "round-robin": (800, 8.0, 280),
            },
            Ratios(
                p90_vs_shared=4.5,
                hits_vs_oracle=0.95,
                throughput_vs_shared=1.2,
                throughput_vs_round_robin=1.5,
            ),
        ),
        ({"kv": (200, 12.0, 950)}, Ratios()),
        ({"shared": (900, 10.0, 300), "kv": (0, 12.0, 950)}, Ratios(throughput_vs_shared=1.2)),
    ],
)
def test_the_ratios_the_targets_name(policies, expected):
    rows = []
    for policy, (p90, per_s, cached) in policies.items():
        row = summarize(policy, outcomes([p90 / 1000], cached), seconds=1.0)
        row.ttft_p90_ms, row.tokens_per_s, row.cached_tokens = p90, per_s, cached
        rows.append(row)
    got = ratios(rows)
    for field in Ratios.__struct_fields__:
        a, b = getattr(got, field), getattr(expected, field)
        assert (a is None and b is None) or math.isclose(a, b), (field, a, b)


def test_the_ratio_lines_say_which_targets_are_met():
    text = ratio_lines(Ratios(p90_vs_shared=2.5, hits_vs_oracle=0.97, throughput_vs_shared=1.01))
    assert "2.50x** (target >= 3x: **not met**)" in text
    assert "97.0%** (target >= 95%: met)" in text
    assert "1.01x** (target >= 1x: met)" in text


def test_a_workers_cache_holds_its_share_of_the_workload_and_at_least_four_long_requests():
    work = PrefixWorkload()
    assert kv_cache_bytes(work, 100, 0.5) == int(work.distinct_tokens * 0.5) * 100
    tiny_share = kv_cache_bytes(work, 100, 0.01)
    assert tiny_share == 4 * (work.longest_prompt + work.output_len) * 100


def test_the_bench_model_is_cached_apart_from_the_tiny_model():
    assert tinymodel.model_dir(tinymodel.TINY) == tinymodel.default_model_dir()
    bigger = tinymodel.Shape(layers=6, hidden=512, max_positions=2048)
    assert tinymodel.model_dir(bigger) != tinymodel.default_model_dir()
    assert "l6-h512-p2048" in tinymodel.model_dir(bigger).name
    assert tinymodel.TINY.kv_bytes_per_token == 2048  # the tiny model's (docs/benchmarks.md)
    assert (tinymodel.TINY.heads, tinymodel.TINY.kv_heads) == (4, 2)


def test_an_unknown_policy_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["bench-routing", "--policies", "kv,random"])
    assert "--policies takes shared, round-robin, kv, oracle" in capsys.readouterr().err
    args = parser().parse_args(["bench-routing", "--policies", "kv,oracle"])
    assert args.policies == ["kv", "oracle"]


def test_the_command_runs_every_policy_on_the_light_engine(nats_url, tmp_path):
    """End to end on three light-engine workers (which cache nothing): every request of every
    policy completes, round-robin and the oracle direct their jobs where they say, and the report
    is written into its section."""
    out, doc = tmp_path / "rows.json", tmp_path / "bench.md"
    doc.write_text(
        "# Benchmarks\n\nprose\n<!-- bench-routing:begin -->\nold\n<!-- bench-routing:end -->\nmore\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "jetllm", "bench-routing", "--engine", "fake", "--nats", nats_url]
        + ["--groups", "2", "--per-group", "3", "--prefix-len", "32", "--suffix-len", "4"]
        + ["--sessions", "1", "--turns", "2", "--turn-len", "4", "--output-len", "3", "--concurrency", "3"]
        + ["--json", str(out), "--write", str(doc)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["shared", "round-robin", "kv", "oracle"]
    for row in rows.values():
        assert (row["requests"], row["errors"], row["cached_tokens"]) == (8, 0, 0), row
        assert row["tokens_per_s"] > 0 and row["ttft_p90_ms"] >= row["ttft_p50_ms"] > 0
    assert rows["round-robin"]["per_worker"] == [3, 3, 2]  # 8 jobs in turn over 3 workers
    assert rows["oracle"]["per_worker"] == [3, 3, 2]  # each prefix (3, 3 and 2 requests) on its own
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nprose\n<!-- bench-routing:begin -->\nMeasured ")
    assert "| KV-aware router |" in text and "cache-hit tokens, KV-aware / oracle" not in text  # 0 / 0
    assert text.endswith("<!-- bench-routing:end -->\nmore\n") and "\nold\n" not in text
