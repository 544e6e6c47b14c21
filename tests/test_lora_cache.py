"""The adapter cache stays within its limit without pulling a copy from under an engine that may
read it again (vLLM reloads evicted adapters from their path, and dies if the path is gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from jetllm import tinymodel
from jetllm.producer.lora import LoraAdmin
from jetllm.workers.lora import LoraSettings
from jetllm.workers.lora.cache import hold, prune, size

from .conftest import inproc_worker
from .test_lora_plane import TINY_FACTS


def _copy(cache: Path, name: str, nbytes: int, used: float) -> Path:
    d = cache / name
    d.mkdir(parents=True)
    (d / "adapter_model.safetensors").write_bytes(b"x" * nbytes)
    os.utime(d, (used, used))
    return d


def test_prune_removes_the_least_recently_used_copies_nobody_holds(tmp_path: Path):
    now = time.time()
    old, mid, new = (
        _copy(tmp_path, n, 1000, now - age) for n, age in (("old", 300), ("mid", 200), ("new", 100))
    )
    held = hold(old)  # in use: kept although it is the oldest
    assert held is not None
    assert prune(tmp_path, 1500) == ["mid", "new"]
    assert old.is_dir() and not mid.exists() and not new.exists()
    assert prune(tmp_path, 0) == []  # held copies stay even when the cache is over its limit
    held.release()
    assert prune(tmp_path, 0) == ["old"] and size(tmp_path) == 0
    assert not any(tmp_path.iterdir())  # nothing half-deleted left behind


def test_a_copy_held_by_a_process_is_kept_until_that_process_is_killed(tmp_path: Path):
    copy = _copy(tmp_path, "a", 1000, time.time())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from jetllm.workers.lora.cache import hold;"
            " h = hold(Path(sys.argv[1])); print(h is not None, flush=True); time.sleep(600)",
            str(copy),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "True"
        assert prune(tmp_path, 0) == [] and copy.is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel drops its lock, however it died
        holder.wait()
    assert prune(tmp_path, 0) == ["a"]


def test_a_pruned_copy_cannot_be_held(tmp_path: Path):
    copy = _copy(tmp_path, "a", 10, time.time())
    assert prune(tmp_path, 0) == ["a"]
    assert hold(copy) is None  # the worker fetches it again


@pytest.mark.anyio
async def test_a_worker_prunes_unloaded_adapters_and_keeps_loaded_ones(nats_url, namespace, tmp_path):
    from jetllm.producer import Client

    from .fake_engine import FakeEngine

    allowed, cache = tmp_path / "allowed", tmp_path / "cache"
    for seed, name in enumerate("abc", start=1):
        tinymodel.build_lora(allowed / name, seed=seed)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(cache), load_wait=5, cache_max_bytes=1)
    engine = FakeEngine()
    engine.facts.lora = TINY_FACTS
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        async with inproc_worker(nats_url, engine, namespace=namespace, lora=settings):
            with anyio.fail_after(10):
                while not (await admin.list("fake")).replies:
                    await anyio.sleep(0.05)
            shas = {}
            for name in "ab":
                shas[name] = (
                    (await admin.load("fake", name, source="path", ref=str(allowed / name)))
                    .replies[0]
                    .adapter.sha256
                )
            assert {p.name for p in cache.iterdir()} == set(
                shas.values()
            )  # both in use: over the limit, kept
            await admin.unload("fake", "a")
            shas["c"] = (
                (await admin.load("fake", "c", source="path", ref=str(allowed / "c")))
                .replies[0]
                .adapter.sha256
            )
            with anyio.fail_after(10):
                while {p.name for p in cache.iterdir()} != {shas["b"], shas["c"]}:
                    await anyio.sleep(0.05)
            for adapter in engine.adapters.values():  # what the engine would read again is still there
                assert (Path(adapter.path) / "adapter_model.safetensors").is_file()
            await admin.unload("fake", "b")
            out = await admin.load("fake", "a", source="path", ref=str(allowed / "a"))  # fetched again
            assert out.replies[0].action == "loaded" and out.replies[0].adapter.sha256 == shas["a"]
            assert (
                Path(engine.adapters[out.replies[0].adapter.lora_id].path) / "adapter_config.json"
            ).is_file()
