"""LoRA adapters across a fleet of real vLLM workers: load from a path and from the object store,
validation before the engine, one load per adapter, identity by content hash, later workers, unload."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

from jetllm import tinymodel
from jetllm.errors import RequestFailed
from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.producer.lora import LoraAdmin
from jetllm.schemas import AdapterList, AdapterReply, ControlFailed, ErrorCode, StopConditions
from jetllm.workers.lora import adapter_id

from .conftest import TINY
from .jobs import req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

PROMPT = [(7 * i + 3) % 500 + 4 for i in range(80)]  # two and a half KV blocks of 32


def lora_args(allowed: Path, cache: Path) -> tuple[str, ...]:
    return (
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-dir",
        str(allowed),
        "--lora-cache-dir",
        str(cache),
        "--slots",
        "8",
    )


async def run(c: Client, adapter: str | None = None):
    return await c.complete(
        req(TINY, PROMPT, adapter=adapter, stop=StopConditions(max_tokens=16, ignore_eos=True))
    )


async def refused(c: Client, adapter: str) -> ErrorCode:
    with pytest.raises(RequestFailed) as info:
        await run(c, adapter)
    return info.value.code


def one(out, action: str | None = None) -> AdapterReply:
    assert len(out.replies) == 1 and not out.missing, out
    reply = out.replies[0]
    assert isinstance(reply, AdapterReply), reply
    if action:
        assert reply.action == action, reply
    return reply


def failure(out) -> ErrorCode:
    assert len(out.replies) == 1 and isinstance(out.replies[0], ControlFailed), out
    assert out.rolled_back, "a load every instance refused must not stay in the desired state"
    return out.replies[0].code


async def lora_loads(c: Client, instance: str) -> int:
    s = await instance_status(c.nc, c.names, instance)
    return int(s.extra.get("lora_loads", "0"))


async def test_adapters_load_validate_reload_reach_later_workers_and_unload(
    nats_url, namespace, start_worker, tmp_path
):
    allowed, outside = tmp_path / "adapters", tmp_path / "outside"
    alpha = tinymodel.build_lora(allowed / "alpha", seed=1)
    beta = tinymodel.build_lora(tmp_path / "upload" / "beta", seed=2)
    gamma = tinymodel.build_lora(allowed / "gamma", seed=4)
    tinymodel.build_lora(outside / "evil", seed=5)
    tinymodel.build_lora(allowed / "wide", seed=6, rank=16)
    corrupt = tinymodel.build_lora(allowed / "corrupt", seed=7)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    os.symlink(outside / "evil", allowed / "sneaky")

    # a cache limit of 1 byte: every load prunes all copies the engine does not hold
    first = start_worker(namespace, *lora_args(allowed, tmp_path / "cache1"), "--lora-cache-max-bytes", "1")
    await first.wait_ready(nats_url)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=30) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=60)
        base = await run(c)
        assert await refused(c, "alpha") == ErrorCode.UNKNOWN_ADAPTER

        # from a path: loaded under an id derived from its name and content hash
        loaded = one(await admin.load(TINY, "alpha", source="path", ref=str(alpha)), "loaded")
        assert loaded.instance == first.instance
        assert loaded.adapter.lora_id == adapter_id("alpha", loaded.adapter.sha256)
        with_alpha = await run(c, "alpha")
        assert with_alpha.token_ids != base.token_ids

        # from the object store, asked twice at once: one engine load, two successes
        pushed = await admin.push(beta, "beta")
        before = await lora_loads(c, first.instance)
        outs = []

        async def load_beta() -> None:
            outs.append(await admin.load(TINY, "beta", source="object", ref="beta"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load_beta)
            tg.start_soon(load_beta)
        replies = [one(out) for out in outs]
        assert {r.adapter.sha256 for r in replies} == {pushed.sha256}
        assert await lora_loads(c, first.instance) == before + 1
        with_beta = await run(c, "beta")
        assert with_beta.token_ids not in (base.token_ids, with_alpha.token_ids)

        # refused before the engine sees them; every refusal is typed and rolled back
        assert (
            failure(await admin.load(TINY, "gamma", source="path", ref=str(gamma)))
            == ErrorCode.NO_ADAPTER_SLOT
        )
        assert (
            failure(await admin.load(TINY, "evil", source="path", ref=str(outside / "evil")))
            == ErrorCode.ADAPTER_NOT_ALLOWED
        )
        assert (
            failure(await admin.load(TINY, "sneaky", source="path", ref=str(allowed / "sneaky")))
            == ErrorCode.ADAPTER_NOT_ALLOWED
        )
        assert (
            failure(
                await admin.load(TINY, "dotdot", source="path", ref=str(allowed / ".." / "outside" / "evil"))
            )
            == ErrorCode.ADAPTER_NOT_ALLOWED
        )
        assert (
            failure(await admin.load(TINY, "missing", source="path", ref=str(allowed / "missing")))
            == ErrorCode.ADAPTER_NOT_FOUND
        )
        assert (
            failure(await admin.load(TINY, "nothing", source="object", ref="beta", sha256="0" * 64))
            == ErrorCode.ADAPTER_NOT_FOUND
        )
        assert (
            failure(await admin.load(TINY, "corrupt", source="path", ref=str(corrupt)))
            == ErrorCode.ADAPTER_INVALID
        )
        assert (
            failure(await admin.load(TINY, "wide", source="path", ref=str(allowed / "wide")))
            == ErrorCode.ADAPTER_INVALID
        )
        assert [s.name for s in await admin.desired(TINY)] == ["alpha", "beta"]
        assert await refused(c, "evil") == ErrorCode.UNKNOWN_ADAPTER
        # the engine is alive and unchanged
        assert (await run(c)).token_ids == base.token_ids
        assert (await run(c, "alpha")).token_ids == with_alpha.token_ids

        # new weights under the same name: new identity, nothing reused from the prefix cache
        tinymodel.build_lora(alpha, seed=3)
        reloaded = one(await admin.load(TINY, "alpha", source="path", ref=str(alpha)), "reloaded")
        assert reloaded.adapter.sha256 != loaded.adapter.sha256
        assert reloaded.adapter.lora_id != loaded.adapter.lora_id
        new_alpha = await run(c, "alpha")
        assert new_alpha.usage.cached_tokens == 0, "blocks cached for the old weights were reused"
        assert new_alpha.token_ids != with_alpha.token_ids
        assert one(await admin.load(TINY, "alpha", source="path", ref=str(alpha)), "unchanged")
        # the old weights' copy left the cache; what the engine holds stayed and still serves
        with anyio.fail_after(10):
            while {p.name for p in (tmp_path / "cache1").iterdir()} != {
                reloaded.adapter.sha256,
                pushed.sha256,
            }:
                await anyio.sleep(0.1)
        assert (await run(c, "alpha")).token_ids == new_alpha.token_ids
        assert (await run(c, "beta")).token_ids == with_beta.token_ids

        # a worker started later loads the desired set by itself and serves it
        second = start_worker(namespace, *lora_args(allowed, tmp_path / "cache2"))
        await second.wait_ready(nats_url)
        with anyio.fail_after(60):
            while True:
                out = await admin.list(TINY, instance=second.instance)
                listed = out.replies[0] if out.replies else None
                if isinstance(listed, AdapterList) and len(listed.adapters) == 2:
                    break
                await anyio.sleep(0.2)
        assert {a.name: a.sha256 for a in listed.adapters} == {
            "alpha": reloaded.adapter.sha256,
            "beta": pushed.sha256,
        }
        everyone = await admin.list(TINY)
        assert sorted(r.instance for r in everyone.replies) == sorted([first.instance, second.instance])
        first.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(first.wait, 120) == 0
        on_second = await run(c, "beta")
        assert on_second.worker == second.instance
        assert on_second.token_ids == with_beta.token_ids
        assert (await run(c, "alpha")).token_ids == new_alpha.token_ids

        # unloaded: a typed error, never the base model
        assert one(await admin.unload(TINY, "beta"), "unloaded").instance == second.instance
        assert await refused(c, "beta") == ErrorCode.UNKNOWN_ADAPTER
        assert await admin.desired(TINY) == [s for s in await admin.desired(TINY) if s.name == "alpha"]
