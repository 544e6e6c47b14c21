"""The KV buckets and object stores every worker and producer creates on start: racing creators all
get the bucket, and one made earlier with other settings is opened as it is."""

from __future__ import annotations

import anyio
import pytest

from jetllm.producer.embeds import embeds_store
from jetllm.producer.lora import ensure_adapters_store
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.subjects.setup import ensure_lora_bucket, ensure_registry
from jetllm.subjects.streams import RECORD_TTL

pytestmark = pytest.mark.anyio


async def test_creators_racing_for_a_bucket_all_get_it(nats_url, namespace):
    names = Names(namespace)
    nc = await connect(nats_url, name="bucket-racers")
    try:
        js = nc.jetstream()
        got: dict[str, list] = {}

        async def one(ensure) -> None:
            got.setdefault(ensure.__name__, []).append(await ensure(js, names))

        async with anyio.create_task_group() as tg:
            for ensure in [ensure_registry, ensure_lora_bucket, ensure_adapters_store] * 4:
                tg.start_soon(one, ensure)
        assert sorted(len(v) for v in got.values()) == [4, 4, 4]
        registry = await js.stream_info(f"KV_{names.registry_bucket}")
        assert registry.config.max_age == RECORD_TTL and registry.config.max_msgs_per_subject == 1
        assert (await js.stream_info(f"KV_{names.lora_bucket}")).config.max_msgs_per_subject == 5
        registries = got["ensure_registry"]
        await registries[0].put("i.x", b"seen by every creator")
        assert [(await kv.get("i.x")).value for kv in registries] == [b"seen by every creator"] * 4
    finally:
        await nc.close()


async def test_a_store_made_with_other_settings_is_opened_as_it_is(nats_url, namespace):
    names = Names(namespace)
    nc = await connect(nats_url, name="bucket-settings")
    try:
        js = nc.jetstream()
        first = await embeds_store(js, names, ttl=60)
        await first.put("kept", b"data")
        later = await embeds_store(js, names, ttl=3600)  # another producer's max_age
        assert (await later.get("kept")).data == b"data"
        info = await js.stream_info(f"OBJ_{names.embeds_store}")
        assert info.config.max_age == 60
    finally:
        await nc.close()
