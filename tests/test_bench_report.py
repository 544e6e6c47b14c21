"""What `jetllm bench` reports from its rounds (jetllm/bench/report.py), without running an engine:
medians per target, ratios of the medians, and ratios round by round."""

import pytest

from jetllm.bench import box
from jetllm.bench.report import report, round_ratios, ttft_breakdown
from jetllm.bench.targets import DIRECT, GATEWAY, JETLLM, OPENAI
from jetllm.bench.workload import Summary, Workload
from jetllm.workers.engine import EngineOptions


def row(target: str, tok_s: float, ttft: float = 40.0) -> Summary:
    return Summary(
        target=target,
        requests=256,
        output_tokens=32768,
        seconds=32768 / tok_s,
        tokens_per_s=tok_s,
        ttft_p50_ms=ttft,
        ttft_p99_ms=ttft * 2,
        itl_p50_ms=5.0,
        itl_p99_ms=10.0,
    )


@pytest.mark.parametrize(
    ("rounds", "lines"),
    [
        # The box slows down between rounds: each round's ratio is steady, the medians' is not.
        (
            [
                [row(DIRECT, 6000), row(DIRECT, 4500), row(DIRECT, 5000)],
                [row(JETLLM, 5700), row(JETLLM, 4275), row(JETLLM, 4750)],
            ],
            ["- jetllm / direct throughput round by round: 0.950x, 0.950x, 0.950x (median 0.950x)"],
        ),
        (
            [[row(GATEWAY, 4000), row(GATEWAY, 3000)], [row(OPENAI, 4000), row(OPENAI, 4000)]],
            [
                "- jetllm gateway / vLLM OpenAI server throughput round by round: 1.000x, 0.750x (median 0.875x)"
            ],
        ),
        (
            [
                [row(DIRECT, 6000), row(DIRECT, 5000)],
                [row(JETLLM, 5400), row(JETLLM, 5000)],
                [row(OPENAI, 4500), row(OPENAI, 4000)],
            ],
            [
                "- jetllm / direct throughput round by round: 0.900x, 1.000x (median 0.950x)",
                "- jetllm / vLLM OpenAI server throughput round by round: 1.200x, 1.250x (median 1.225x)",
            ],
        ),
        ([[row(DIRECT, 6000)], [row(JETLLM, 5000)]], []),  # one round: the ratio of the medians says it all
        ([[row(JETLLM, 5000), row(JETLLM, 5000)]], []),  # nothing to compare with
    ],
    ids=["drift", "gateway", "three-targets", "one-round", "one-target"],
)
def test_round_by_round_ratios(rounds, lines):
    assert round_ratios(rounds) == "\n".join(lines)


def test_the_report_gives_medians_their_ratio_and_the_ratio_of_each_round():
    rounds = [
        [row(DIRECT, 6000, 30), row(DIRECT, 4000, 50), row(DIRECT, 5000, 40)],
        [row(JETLLM, 5400, 45), row(JETLLM, 4000, 52), row(JETLLM, 4800, 48)],
    ]
    work = Workload(requests=256, concurrency=32, prompt_len=30, output_len=128, warmup=32)
    text = report(work, EngineOptions(model="tiny", dtype="float32"), rounds, "jetllm bench")
    assert "| AsyncLLM direct | 5,000 | 40.0 |" in text  # medians of each figure
    assert "| through jetllm | 4,800 | 48.0 |" in text
    assert "jetllm / direct throughput: **0.960x**" in text  # medians' ratio
    assert "TTFT p50 added by jetllm: **+8.0 ms**" in text
    assert "round by round: 0.900x, 1.000x, 0.960x (median 0.960x)" in text


HOPS = dict(queued_p50_ms=1.0, worker_ttft_p50_ms=39.4, worker_wait_p50_ms=2.1, worker_accept_p50_ms=15.1)
PRODUCER_LEGS = dict(publish_p50_ms=1.4, frame_back_p50_ms=1.1)


@pytest.mark.parametrize(
    ("hops", "says", "omits"),
    [
        (
            HOPS | PRODUCER_LEGS,
            [
                "1.4 ms from the producer's call to JetStream storing the job, 1.0 ms from storing it to a "
                "worker pulling it, 39.4 ms from the pull to the first token frame sent (direct TTFT: "
                "34.9 ms), of which 2.1 ms until the job's task ran and 15.1 ms to its `accepted` frame, "
                "1.1 ms from the worker sending that frame to the producer reading it"
            ],
            [],
        ),
        (  # rounds of an older report, or records without the producer's clock: the hops it has
            HOPS | {"worker_accept_p50_ms": None, "worker_wait_p50_ms": None},
            ["1.0 ms from storing it to a worker pulling it, 39.4 ms from the pull", "34.9 ms)"],
            ["producer's call", "of which", "producer reading it"],
        ),
    ],
    ids=["every-hop", "worker-hops-only"],
)
def test_the_ttft_breakdown_names_each_hop_it_measured(hops, says, omits):
    j = row(JETLLM, 5000, 44.2)
    for name, value in hops.items():
        setattr(j, name, value)
    line = ttft_breakdown(j, 34.9)
    assert line.startswith("- where jetllm's TTFT goes")
    assert all(s in line for s in says), line
    assert not any(o in line for o in omits), line


STAT = "cpu  {} 0 {} {} 0 0 0 {} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 1 2\n"


@pytest.mark.parametrize(
    ("before", "after", "stolen"),
    [
        (STAT.format(100, 50, 1000, 0), STAT.format(900, 150, 1900, 0), 0.0),  # a box to itself
        (STAT.format(100, 50, 1000, 10), STAT.format(600, 150, 1300, 110), 0.1),  # a tenth taken
        (STAT.format(100, 50, 1000, 10), STAT.format(100, 50, 1000, 10), None),  # no time passed
    ],
)
def test_the_hosts_share_of_the_cpu_comes_from_proc_stat(before, after, stolen):
    share = box.stolen_share(box.cpu_times(before), box.cpu_times(after))
    assert share == (pytest.approx(stolen) if stolen is not None else None)


@pytest.mark.parametrize("text", ["", "intr 1 2\n", "cpu 1 2 3\n", "cpu a b c d e f g h\n"])
def test_a_proc_stat_without_the_counters_gives_none(text):
    assert box.cpu_times(text) is None


def test_the_report_carries_the_box_line_under_its_first_line():
    line = box.describe(480.4, 512.6, 0.017, 0.08)
    assert line == (
        "Box: a reference loop (2,000,000 Python additions, `jetllm.bench.box`) took 480 ms before the run "
        "and 513 ms after; the host took 1.7 % of the CPU time during the run for others (steal); "
        "load average 0.08 before it."
    )
    rounds = [[row(DIRECT, 5000)], [row(JETLLM, 4800)]]
    work = Workload(requests=256, concurrency=32, prompt_len=30, output_len=128, warmup=32)
    text = report(work, EngineOptions(model="tiny", dtype="float32"), rounds, "jetllm bench", line)
    assert text.splitlines()[2] == line
    assert "Box:" not in report(work, EngineOptions(model="tiny", dtype="float32"), rounds, "jetllm bench")


PROC_STAT = "4242 ({}) S 1 4242 4242 0 -1 4194560 9000 0 12 0 {} {} 3 4 20 0 5 0 777 1000 200\n"


@pytest.mark.parametrize(
    ("text", "ticks"),
    [
        (PROC_STAT.format("python", 1500, 250), 1750),  # user + system, not the children's
        (PROC_STAT.format("VLLM::Engine Core", 10, 5), 15),  # a name with a space
        (PROC_STAT.format("a) b (c", 7, 0), 7),  # parentheses inside the name
        ("", None),
        ("4242 (python) S 1 2 3\n", None),  # cut short
        (PROC_STAT.format("python", "x", 1), None),
    ],
)
def test_a_process_cpu_time_comes_from_its_proc_stat_line(text, ticks):
    assert box.process_ticks(text) == ticks


def test_a_process_that_is_gone_counts_no_cpu_and_a_live_one_some():
    import os

    assert box.cpu_seconds([2**22 + 12345]) == 0.0
    spent = sum(range(3_000_000))
    assert spent and box.cpu_seconds([os.getpid()]) > 0.0


def test_the_batch_report_gives_cpu_per_line_where_it_was_measured():
    import argparse

    from jetllm.bench.batch import Figures, Round
    from jetllm.bench.batch import report as batch_report

    offline = [Round(2.0, 6400, {"front end": x}) for x in (0.3, 0.1, 0.2)]
    plane = {"worker": 0.6, "NATS server": 0.1, "producer": 0.2}
    rows = [
        Figures.of("offline", 100, offline),
        Figures.of("batch API", 100, [Round(4.0, 6400, plane)]),
        Figures.of("not measured", 100, [Round(3.2, 6400)]),
    ]
    args = argparse.Namespace(lines=100, prompt_len=30, output_len=64, max_num_seqs=256)
    text = batch_report(rows, args, "jetllm bench-batch").splitlines()
    assert [line for line in text if line.startswith("| ")][1:] == [
        "| offline | 2.00 | 3,200 | 1.00x | 2.00 | 2.00, 2.00, 2.00 |",
        "| batch API | 4.00 | 1,600 | 0.50x | 9.00 | 4.00 |",
        "| not measured | 3.20 | 2,000 | 0.62x | - | 3.20 |",
    ]
    assert [line for line in text if line.startswith("- ")] == [
        "- offline: front end 2.00 ms",
        "- batch API: worker 6.00 ms, NATS server 1.00 ms, producer 2.00 ms",
    ]
