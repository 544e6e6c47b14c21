"""The router's memory of where it just sent a prompt, before the blocks show up in the KV events."""

from __future__ import annotations

import time

import msgspec
import pytest

from jetllm.router import Router
from jetllm.router.pending import PendingBlocks, RecentJobs
from jetllm.schemas import EngineInfo, InstanceRecord, Routed

from .jobs import req

B = 4


def fleet_router(*names: str, running: dict[str, int] | None = None) -> Router:
    """A router that knows `names` (8 slots each, `running` busy) and has seen no KV event."""
    router = Router("m", block_size=B)
    router._on_instances(
        {
            n: InstanceRecord(
                instance=n,
                role="generate",
                model="m",
                state="serving",
                ready=True,
                slots=8,
                in_flight=(running or {}).get(n, 0),
                engine=EngineInfo(block_size=B),
                heartbeat_at=time.time(),
                expires_after=600,
            )
            for n in names
        }
    )
    return router


def test_a_sent_prompt_counts_as_held_by_its_instance_until_it_expires():
    p = PendingBlocks(ttl=10.0)
    p.note([1, 2, 3, 4], "a", now=0.0)
    assert p.holder([1, 2, 3, 4, 5], now=1.0) == ("a", 4)
    assert p.holder([1, 2, 9], now=1.0) == ("a", 2)
    assert p.holder([7, 1, 2], now=1.0) is None  # only a leading run counts
    assert p.holder([], now=1.0) is None
    assert p.holder([1, 2], now=10.0) is None


def test_the_latest_placement_of_a_block_wins_and_the_run_stops_at_another_instance():
    p = PendingBlocks()
    p.note([1, 2, 3], "a", now=0.0)
    p.note([1, 2, 5], "b", now=1.0)
    assert p.holder([1, 2, 3], now=2.0) == ("b", 2)


def test_past_the_limit_expired_blocks_go_then_the_oldest():
    p = PendingBlocks(ttl=10.0, limit=4)
    p.note([1, 2], "a", now=0.0)
    p.note([3, 4], "b", now=5.0)
    p.note([5], "c", now=12.0)  # over the limit: 1 and 2 have expired
    assert len(p) == 3 and p.holder([3, 4], now=12.0) == ("b", 2)
    p.note([6, 7], "d", now=12.0)  # over again, nothing expired: the oldest go
    assert len(p) == 3 and p.holder([3], now=12.0) is None and p.holder([6, 7], now=12.0) == ("d", 2)


def test_the_next_jobs_of_a_new_prefix_follow_the_first_before_its_blocks_are_reported():
    router = fleet_router("w1", "w2", "w3")
    prefix = list(range(100, 164))  # 16 blocks
    first = router.decide(req("m", prefix + [1, 2]), prefix + [1, 2])
    assert first.instance is not None and first.why.startswith("prompt's home")
    for tail in ([3, 4, 5], [6], [7, 8, 9, 10, 11]):
        tokens = prefix + tail
        follower = router.decide(req("m", tokens), tokens)
        assert follower.instance == first.instance, follower.why
        assert follower.why.startswith("64/")  # the prefix counted as held where it was sent


def test_a_pending_holder_that_is_busy_loses_as_a_reported_one_would():
    router = fleet_router("w1", "w2", "w3", running={"w1": 0, "w2": 0, "w3": 0})
    prefix = list(range(100, 112))  # 3 blocks: little to save
    first = router.decide(req("m", prefix + [1]), prefix + [1])
    busy = {n: (8 if n == first.instance else 0) for n in ("w1", "w2", "w3")}
    router = fleet_router("w1", "w2", "w3", running=busy)
    router.pending = PendingBlocks()
    router.pending.note(router._chain(prefix + [1], None), first.instance, time.monotonic())
    follower = router.decide(req("m", prefix + [2]), prefix + [2])
    assert follower.instance != first.instance, follower.why


def test_a_prompt_of_less_than_a_block_is_left_to_the_shared_queue():
    router = fleet_router("w1", "w2")
    assert router.decide(req("m", [1, 2, 3]), [1, 2, 3]).instance is None


def test_recent_jobs_halve_every_half_life():
    r = RecentJobs(half_life=10.0)
    r.add("a", now=0.0)
    r.add("a", now=0.0)
    assert r.of("a", now=0.0) == 2.0 and r.of("a", now=10.0) == 1.0 and r.of("b", now=0.0) == 0.0
    r.forget("a")
    assert r.of("a", now=0.0) == 0.0


def test_new_prefixes_at_equal_load_get_homes_spread_evenly():
    router = fleet_router("w1", "w2", "w3")
    homes = []
    for g in range(6):
        prefix = [1000 * (g + 1) + i for i in range(64)]
        homes.append(router.decide(req("m", prefix + [1]), prefix + [1]).instance)
    assert sorted(homes.count(w) for w in ("w1", "w2", "w3")) == [2, 2, 2], homes


def test_a_new_prefix_another_router_placed_goes_where_that_router_sent_it():
    """Two routers in front of one fleet: the second hears where the first sent a new prefix and
    sends its jobs there too, though on its own it would have chosen another home."""
    prefix = list(range(100, 164))
    first_router = fleet_router("w1", "w2", "w3")
    first = first_router.decide(req("m", prefix + [1]), prefix + [1])
    (note,) = first_router.notes
    assert (note.instance, note.router) == (first.instance, first_router.id)

    def biased() -> Router:  # it sent the most jobs lately to that home: alone, it goes elsewhere
        r = fleet_router("w1", "w2", "w3")
        for _ in range(3):
            r.recent.add(first.instance, time.monotonic())
        return r

    alone = biased().decide(req("m", prefix + [2]), prefix + [2])
    assert alone.instance not in (None, first.instance), alone.why
    told = biased()
    told.heard(note)
    follower = told.decide(req("m", prefix + [2]), prefix + [2])
    assert follower.instance == first.instance, follower.why
    own = biased()
    own.heard(msgspec.structs.replace(note, router=own.id))  # its own note changes nothing
    assert own.decide(req("m", prefix + [2]), prefix + [2]).instance == alone.instance


@pytest.mark.anyio
async def test_an_unreadable_placement_note_is_skipped():
    router = fleet_router("w1", "w2")

    class Msg:
        data = b"\xc1 not msgpack"

    await router._on_routed(Msg())
    assert len(router.pending) == 0


def test_a_note_about_an_instance_the_router_does_not_know_is_ignored():
    router = fleet_router("w1", "w2")
    router.heard(Routed(router="other", instance="nobody", blocks=[1, 2, 3]))
    assert len(router.pending) == 0 and router.recent.of("nobody", time.monotonic()) == 0.0
