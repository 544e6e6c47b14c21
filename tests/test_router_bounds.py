"""The router's memory is bounded by the registry, not by the names that come by on the bus: load
reports and KV events of an instance (or a rank) the registry does not show are not kept, apart
from a short, bounded hold for a worker whose first events beat its registry record. Pure: the
feed's synchronous half, the hold and the load book, driven by tables."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from jetllm.router.early import HOLD_BATCHES, HOLD_FOR, HOLD_SIZE, EarlyBatches, size_of
from jetllm.router.feed import KvFeed, LoadBook
from jetllm.router.hashing import BlockHasher
from jetllm.router.index import BlockIndex
from jetllm.router.metrics import RouterCollector
from jetllm.router.router import SNAPSHOT_GRACE
from jetllm.schemas import (
    EngineInfo,
    InstanceRecord,
    KvCleared,
    KvEventBatch,
    KvResync,
    KvStored,
    LoadReport,
)
from jetllm.subjects import codec

from .test_router_pending import fleet_router

B = 4
H = BlockHasher(B)
A = list(range(100, 116))  # 4 blocks
C = list(range(200, 216))


def record(name: str, ranks: tuple[int, ...] = (0,)) -> InstanceRecord:
    return InstanceRecord(
        instance=name,
        role="generate",
        model="m",
        state="serving",
        ready=True,
        slots=8,
        dp_ranks=list(ranks),
        engine=EngineInfo(block_size=B),
        heartbeat_at=time.time(),
        expires_after=600,
    )


def stored(tokens: list[int]) -> KvStored:
    return KvStored(block_hashes=H.chain(tokens), token_ids=tokens, block_size=B)


def batch(inst: str, seq: int, events=(), rank: int = 0, snapshot: bool = False) -> KvEventBatch:
    resync = KvResync(reason="start", part=1, parts=1) if snapshot else None
    return KvEventBatch(instance=inst, model="m", dp_rank=rank, seq=seq, events=list(events), resync=resync)


class Registry:
    """The registry as the feed and the load book see it: name -> record, changed by the test."""

    def __init__(self, **ranks: tuple[int, ...]) -> None:
        self.records = {name: record(name, r) for name, r in ranks.items()}

    def __call__(self, instance: str) -> InstanceRecord | None:
        return self.records.get(instance)


def new_feed(registry: Registry) -> KvFeed:
    return KvFeed(None, None, "m", BlockIndex(), lambda: H, registered=registry)  # type: ignore[arg-type]


# the hold: (case, bounds, holds as (instance, seq, tokens, at), when to look, instances taken,
# the batches taken as (instance, seq), dropped in all, held after)
HOLD_CASES = [
    (
        "taken in arrival order, the others stay",
        {},
        [("x", 1, 0, 0.0), ("y", 1, 0, 0.0), ("x", 2, 0, 1.0)],
        2.0,
        {"x"},
        [("x", 1), ("x", 2)],
        0,
        1,
    ),
    (
        "past their time they go",
        {"ttl": 10.0},
        [("x", 1, 0, 0.0), ("x", 2, 0, 5.0)],
        12.0,
        {"x"},
        [("x", 2)],
        1,
        0,
    ),
    (
        "past the batch bound the oldest go",
        {"max_batches": 2},
        [("x", 1, 0, 0.0), ("y", 1, 0, 0.0), ("z", 1, 0, 0.0)],
        1.0,
        {"x", "y", "z"},
        [("y", 1), ("z", 1)],
        1,
        0,
    ),
    (
        "past the id bound the oldest go",
        {"max_size": 30},  # a batch of 10 tokens from "x" of "m" weighs 12
        [("x", 1, 10, 0.0), ("y", 1, 10, 0.0), ("z", 1, 10, 0.0)],
        1.0,
        {"x", "y", "z"},
        [("y", 1), ("z", 1)],
        1,
        0,
    ),
    (
        "a batch heavier than the bound alone is not held",
        {"max_size": 30},
        [("x", 1, 10, 0.0), ("y", 1, 40, 0.0)],
        1.0,
        {"x", "y"},
        [("x", 1)],
        1,
        0,
    ),
    (
        "a long name weighs its length",
        {"max_size": 30},
        [("x" * 400, 1, 0, 0.0)],
        1.0,
        {"x" * 400},
        [],
        1,
        0,
    ),
]


@pytest.mark.parametrize(
    "case,bounds,holds,at,ready,taken,dropped,left", HOLD_CASES, ids=[c[0] for c in HOLD_CASES]
)
def test_the_hold_keeps_batches_briefly_and_within_its_bounds(
    case, bounds, holds, at, ready, taken, dropped, left
):
    early = EarlyBatches(**bounds)
    lost = 0
    for inst, seq, tokens, now in holds:
        events = [KvStored(block_hashes=[], token_ids=list(range(tokens)), block_size=B)] if tokens else []
        held, n = early.hold(batch(inst, seq, events), now)
        lost += n + (not held)
    lost += early.expire(at)
    assert [(b.instance, b.seq) for b in early.take(ready)] == taken
    assert lost == dropped and len(early) == left
    assert early.size == sum(size_of(b) for _, _, b in early._held)
    assert sorted(early.instances()) == sorted({b.instance for _, _, b in early._held})


# the feed: (case, registered at first as name -> ranks, steps, overlaps of A then, resyncs asked,
# counters that must read so). A step: ("batch", instance, seq, events, rank, snapshot),
# ("register", instance, ranks), ("leave", instance) or ("wait", seconds).
FEED_CASES = [
    (
        "a registered instance's batches count",
        {"w1": (0,)},
        [("batch", "w1", 1, [stored(A)], 0, False)],
        {"w1": 4},
        [],
        {"batches": 1, "held_unregistered": 0},
    ),
    (
        "an unregistered instance's batches are held, not indexed",
        {"w1": (0,)},
        [("batch", "ghost", 1, [stored(A)], 0, False)],
        {},
        [],
        {"batches": 0, "held_unregistered": 1},
    ),
    (
        "held batches are applied in order once the record shows, no snapshot asked",
        {},
        [
            ("batch", "w2", 1, [KvCleared()], 0, True),
            ("batch", "w2", 2, [stored(A)], 0, False),
            ("register", "w2", (0,)),
            ("wait", 0.0),
        ],
        {"w2": 4},
        [],
        {"batches": 2, "applied_late": 2, "dropped_unregistered": 0},
    ),
    (
        "the next batch after registering applies the held ones first",
        {},
        [
            ("batch", "w2", 1, [stored(C)], 0, True),
            ("register", "w2", (0,)),
            ("batch", "w2", 2, [stored(A)], 0, False),
        ],
        {"w2": 4},
        [],
        {"batches": 2, "applied_late": 1},
    ),
    (
        "held too long they go; the next batch asks for a snapshot",
        {},
        [
            ("batch", "w2", 1, [stored(A)], 0, True),
            ("wait", HOLD_FOR + 1),
            ("register", "w2", (0,)),
            ("batch", "w2", 2, [stored(C)], 0, False),
        ],
        {},
        ["w2"],
        {"batches": 1, "applied_late": 0, "dropped_unregistered": 1},
    ),
    (
        "a rank the record does not list is dropped",
        {"w1": (0,)},
        [("batch", "w1", 1, [stored(A)], 7, False)],
        {},
        [],
        {"batches": 0, "dropped_unlisted_rank": 1},
    ),
    (
        "every rank the record lists counts",
        {"w1": (0, 1)},
        [("batch", "w1", 1, [stored(A[:8])], 0, False), ("batch", "w1", 2, [stored(A)], 1, False)],
        {"w1": 4},
        [],
        {"batches": 2},
    ),
    (
        "an instance gone: its late batches do not bring it back",
        {"w1": (0,)},
        [
            ("batch", "w1", 1, [stored(A)], 0, False),
            ("leave", "w1"),
            ("batch", "w1", 2, [stored(A)], 0, False),
        ],
        {},
        [],
        {"batches": 1, "held_unregistered": 1},
    ),
]


def run_steps(feed: KvFeed, registry: Registry, steps) -> list[str]:
    now, asked = 1000.0, []
    for step in steps:
        if step[0] == "batch":
            _, inst, seq, events, rank, snapshot = step
            asked += feed.admit(batch(inst, seq, events, rank, snapshot), now)
        elif step[0] == "register":
            registry.records[step[1]] = record(step[1], step[2])
        elif step[0] == "leave":  # as Router._on_instances does
            del registry.records[step[1]]
            feed.index.drop(step[1])
            feed.forget(step[1])
        else:
            now += step[1]
            asked += feed.release(now)
    return asked


@pytest.mark.parametrize(
    "case,registered,steps,overlap,asked,counters", FEED_CASES, ids=[c[0] for c in FEED_CASES]
)
def test_the_feed_indexes_only_what_the_registry_shows(case, registered, steps, overlap, asked, counters):
    registry = Registry(**registered)
    feed = new_feed(registry)
    assert run_steps(feed, registry, steps) == asked
    assert feed.index.overlap(H.chain(A)) == overlap
    assert {k: feed.counters[k] for k in counters} == counters
    assert feed.index.instances() <= set(registry.records) and set(feed.last) <= set(registry.records)


def test_ten_thousand_forged_instances_leave_the_feed_at_its_bound_and_a_real_one_counts():
    registry = Registry(w1=(0,))
    feed = new_feed(registry)
    for i in range(10_000):
        feed.admit(batch(f"forged-{i}", 1 + i % 3, [stored(A)], rank=i % 5), now=i * 0.001)
        feed.admit(batch("w1", 2 + i, [], rank=1000 + i), now=i * 0.001)  # forged ranks of a real one
    assert feed.index.slots == 0 and feed.index.blocks == 0 and feed.last == {}
    assert len(feed.early) <= HOLD_BATCHES and feed.early.size <= HOLD_SIZE
    c = feed.counters
    assert c["held_unregistered"] == 10_000 and c["dropped_unregistered"] == 10_000 - len(feed.early)
    assert c["dropped_unlisted_rank"] == 10_000
    assert feed.admit(batch("w1", 1, [stored(A)]), now=10.0) == []
    assert feed.index.overlap(H.chain(A)) == {"w1": 4} and feed.index.slots == 1
    feed.release(now=10.0 + HOLD_FOR + 1)  # whatever was held has gone by now
    assert len(feed.early) == 0 and feed.early.size == 0 and feed.early.instances() == []
    assert feed.index.slots == 1 and feed.last == {"w1": 1}


# the load book: (case, registered as name -> ranks, reports as (instance, rank, at), when to
# look, ranks of each instance's fresh reports, counters that must read so)
LOAD_CASES = [
    (
        "a registered rank's report is kept",
        {"w1": (0,)},
        [("w1", 0, 0.0)],
        1.0,
        {"w1": [0]},
        {"reports": 1},
    ),
    (
        "an unregistered instance's report is dropped",
        {"w1": (0,)},
        [("ghost", 0, 0.0)],
        1.0,
        {"ghost": []},
        {"reports": 0, "dropped_unregistered": 1},
    ),
    (
        "a rank the record does not list is dropped",
        {"w1": (0, 1)},
        [("w1", 1, 0.0), ("w1", 9, 0.0)],
        1.0,
        {"w1": [1]},
        {"reports": 1, "dropped_unlisted_rank": 1},
    ),
    (
        "the latest report of a rank replaces the one before",
        {"w1": (0,)},
        [("w1", 0, 0.0), ("w1", 0, 3.0)],
        7.0,
        {"w1": [0]},
        {"reports": 2},
    ),
    (
        "a report older than max_age does not count, and goes at the next sweep",
        {"w1": (0,), "w2": (0,)},
        [("w1", 0, 0.0), ("w2", 0, 6.0)],
        6.0,
        {"w1": [], "w2": [0]},
        {"reports": 2, "expired": 1},
    ),
]


@pytest.mark.parametrize(
    "case,registered,reports,at,fresh,counters", LOAD_CASES, ids=[c[0] for c in LOAD_CASES]
)
def test_the_load_book_keeps_registered_ranks_for_max_age(case, registered, reports, at, fresh, counters):
    book = LoadBook(5.0, registered=Registry(**registered))
    for inst, rank, now in reports:
        book.put(
            LoadReport(
                instance=inst, model="m", dp_rank=rank, at=now, running=1, waiting=0, in_flight=1, slots=8
            ),
            now,
        )
    assert {inst: [r.dp_rank for r in book.of(inst, now=at)] for inst in fresh} == fresh
    assert {k: book.counters[k] for k in counters} == counters
    assert set(book.reports) <= set(registered)


def load_msg(inst: str, rank: int = 0, running: int = 1) -> SimpleNamespace:
    report = LoadReport(
        instance=inst,
        model="m",
        dp_rank=rank,
        at=time.time(),
        running=running,
        waiting=0,
        in_flight=0,
        slots=8,
    )
    return SimpleNamespace(data=codec.encode(report))


def test_each_of_ten_thousand_instances_finds_its_own_report():
    """Kept by instance (no registry to check against here), so a lookup reads one instance's
    ranks; how long lookups take is the benchmarks' business, not this test's."""
    book = LoadBook(5.0)
    for i in range(10_000):
        book.take(load_msg(f"w{i}"))
    assert all([r.instance for r in book.of(f"w{i}")] == [f"w{i}"] for i in range(10_000))


def test_ten_thousand_forged_load_reports_leave_the_router_at_its_bound_and_a_real_one_counts():
    router = fleet_router("w1", "w2")
    for i in range(10_000):
        router.loads.take(load_msg(f"forged-{i}"))  # type: ignore[arg-type]
        router.loads.take(load_msg("w1", rank=1 + i))  # type: ignore[arg-type]  # w1 has rank 0 only
    router.loads.take(load_msg("w1", running=5))  # type: ignore[arg-type]
    assert set(router.loads.reports) == {"w1"} and len(router.loads) == 1
    assert {c.instance: c.running for c in router.candidates()} == {"w1": 5, "w2": 0}
    exported = {m.name: m.samples[0].value for m in RouterCollector(router).collect() if m.samples}
    assert exported["jetllm_router_load_dropped_unregistered"] == 10_000
    assert exported["jetllm_router_load_dropped_unlisted_rank"] == 10_000
    assert exported["jetllm_router_load_ranks"] == 1 and exported["jetllm_router_index_slots"] == 0
    router._on_instances({})  # w1 and w2 leave: their reports go with them
    assert router.loads.reports == {}


def test_the_registry_watch_remembers_no_instance_after_the_start_snapshot_stops_counting():
    """The set of instances the watch has shown serves only while the start snapshot counts; it
    kept every name ever registered for the router's life."""
    router = fleet_router("w1")
    router._snapshot = (time.monotonic() - SNAPSHOT_GRACE - 1, {"old": record("old")})
    for i in range(1000):  # worker churn: each restart a new instance id
        router._on_instances({f"w{i}": record(f"w{i}")})
    assert router._watched == set() and set(router.instances) == {"w999"}
