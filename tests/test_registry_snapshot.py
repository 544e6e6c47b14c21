"""Reading the keys of a bucket as they are now (`entries_matching`): the order in which nats-py's
watcher hands over the snapshot and its end marker, as tables; and the real server's buckets."""

from __future__ import annotations

from types import SimpleNamespace

import nats.errors
import pytest
from nats.js.kv import KV_DEL, KeyValue

from jetllm.subjects.connection import connect
from jetllm.subjects.kvsnapshot import entries_matching

pytestmark = pytest.mark.anyio


def entry(key: str, delta: int, op: str | None = None) -> KeyValue.Entry:
    return KeyValue.Entry(
        bucket="b", key=key, value=b"v", revision=1, delta=delta, created=None, operation=op
    )


QUIET = "quiet"
"""Nothing arrives within the reader's timeout."""


class Watcher:
    def __init__(self, updates: list) -> None:
        self._updates = list(updates)
        self.stopped = False

    async def updates(self, timeout: float = 5.0) -> KeyValue.Entry | None:
        if not self._updates:
            raise AssertionError("read past the snapshot: the caller would wait for its timeout")
        update = self._updates.pop(0)
        if update == QUIET:
            raise nats.errors.TimeoutError
        return update

    async def stop(self) -> None:
        self.stopped = True


class Bucket:
    """What `entries_matching` uses of nats-py's KeyValue: a watch, and its stream's subjects."""

    def __init__(self, updates: list, stored: list[str]) -> None:
        self.watcher = Watcher(updates)
        self._stream, self._pre = "KV_b", "$KV.b."

        async def stream_info(name: str, subjects_filter: str | None = None) -> SimpleNamespace:
            return SimpleNamespace(state=SimpleNamespace(subjects={s: 1 for s in stored} or None))

        self._js = SimpleNamespace(stream_info=stream_info)

    async def watch(self, pattern: str, meta_only: bool = False) -> Watcher:
        return self.watcher


@pytest.mark.parametrize(
    "updates, stored, keys",
    [
        ([None], [], []),  # an empty bucket: the marker alone
        ([entry("i.a", 1), entry("i.b", 0), None], ["i.a", "i.b"], ["i.a", "i.b"]),
        # the marker overtook the entries the server had sent: they are still read
        ([None, entry("i.a", 1), entry("i.b", 0)], ["i.a", "i.b"], ["i.a", "i.b"]),
        # a deleted key is not listed, but it can be the snapshot's last entry
        ([entry("i.a", 1), entry("i.b", 0, KV_DEL)], ["i.a", "i.b"], ["i.a"]),
        ([None, entry("i.b", 0, KV_DEL)], ["i.b"], []),
        # a marker after some entries ends it (nats-py skipped a last record of a kind it does not know)
        ([entry("i.a", 1), None], ["i.a", "i.z"], ["i.a"]),
        ([None, QUIET], ["i.z"], []),  # ... or its only record: after the marker, quiet ends it
    ],
)
async def test_the_snapshot_ends_at_the_servers_last_entry_not_at_an_early_marker(updates, stored, keys):
    bucket = Bucket(updates, stored)
    found = await entries_matching(bucket, "i.*")  # type: ignore[arg-type]
    assert [e.key for e in found] == keys
    assert bucket.watcher.stopped


async def test_a_watch_that_stays_silent_before_the_snapshot_ended_is_an_error():
    bucket = Bucket([entry("i.a", 1), QUIET], ["i.a", "i.b"])
    with pytest.raises(nats.errors.TimeoutError):
        await entries_matching(bucket, "i.*")  # type: ignore[arg-type]
    assert bucket.watcher.stopped


async def test_on_a_real_bucket_live_keys_are_listed_and_deleted_ones_not(nats_url):
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket="snapshot_test")
        assert await entries_matching(kv, "i.*") == []
        for key in ("i.a", "i.b", "i.c", "m.x"):
            await kv.put(key, b"1")
        await kv.put("i.a", b"2")
        await kv.delete("i.c")
        found = await entries_matching(kv, "i.*")
        assert sorted((e.key, e.value) for e in found) == [("i.a", b"2"), ("i.b", b"1")]
        assert sorted(e.key for e in await entries_matching(kv, "i.*", meta_only=True)) == ["i.a", "i.b"]
        await kv.delete("i.a")
        await kv.delete("i.b")
        assert await entries_matching(kv, "i.*") == []  # only deleted keys left
        await js.delete_key_value("snapshot_test")
    finally:
        await nc.close()
