"""LoRA lifecycle on the message plane (fake engine): desired state, reconcile, typed errors.
The engine-facing behaviour is checked against real vLLM in test_vllm_lora.py."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from jetllm import tinymodel
from jetllm.adapterfiles import AdapterFileError
from jetllm.errors import RequestFailed
from jetllm.producer.lora import LoraAdmin
from jetllm.schemas import AdapterReply, ControlFailed, ErrorCode
from jetllm.workers.engine import LoraFacts
from jetllm.workers.lora import LoraSettings
from jetllm.workers.lora.validate import validate

from .conftest import inproc_worker
from .jobs import req

pytestmark = pytest.mark.anyio

TINY_FACTS = LoraFacts(
    capacity=2,
    max_rank=8,
    num_layers=2,
    base_names=["tiny"],
    modules={"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128), "o_proj": (256, 256)},
)


def test_validation_names_what_is_wrong(tmp_path: Path):
    good = tinymodel.build_lora(tmp_path / "good")
    assert validate(good, TINY_FACTS) == 8
    cases = {
        "rank": (lambda d: tinymodel.build_lora(d, rank=16), "exceeds this worker's --max-lora-rank 8"),
        "shape": (lambda d: tinymodel.build_lora(d), "shape"),
        "base": (lambda d: tinymodel.build_lora(d), "was made for"),
        "truncated": (lambda d: tinymodel.build_lora(d), "corrupt"),
        "module": (lambda d: tinymodel.build_lora(d), "unknown target modules"),
    }
    for name, (build, message) in cases.items():
        d = build(tmp_path / name)
        if name == "shape":
            (d / "adapter_config.json").write_text(
                (d / "adapter_config.json").read_text().replace('"r": 8', '"r": 4')
            )
        if name == "base":
            (d / "adapter_config.json").write_text(
                (d / "adapter_config.json")
                .read_text()
                .replace('"base_model_name_or_path": null', '"base_model_name_or_path": "org/other-model"')
            )
        if name == "truncated":
            w = d / "adapter_model.safetensors"
            w.write_bytes(w.read_bytes()[:-10])
        if name == "module":
            (d / "adapter_config.json").write_text(
                (d / "adapter_config.json").read_text().replace('"q_proj"', '"lm_head"')
            )
        with pytest.raises(AdapterFileError) as info:
            validate(d, TINY_FACTS)
        assert info.value.code == ErrorCode.ADAPTER_INVALID and message in info.value.message, (
            name,
            info.value,
        )


async def test_desired_state_reaches_every_instance_and_jobs_use_only_loaded_adapters(
    nats_url, namespace, tmp_path
):
    from .fake_engine import FakeEngine

    allowed = tmp_path / "allowed"
    tinymodel.build_lora(allowed / "a", seed=1)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=5)
    engines = [FakeEngine(), FakeEngine()]
    for e in engines:
        e.facts.lora = TINY_FACTS
    from jetllm.producer import Client

    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        async with inproc_worker(nats_url, engines[0], namespace=namespace, lora=settings) as w1:
            with anyio.fail_after(10):
                while not (await admin.list("fake")).replies:
                    await anyio.sleep(0.05)
            out = await admin.load("fake", "a", source="path", ref=str(allowed / "a"))
            assert [r.action for r in out.replies] == ["loaded"], out
            assert list(engines[0].adapters.values())[0].name.startswith("a@")
            await c.complete(req("fake", adapter="a"))
            with pytest.raises(RequestFailed) as info:
                await c.complete(req("fake", adapter="b"))
            assert info.value.code == ErrorCode.UNKNOWN_ADAPTER
            pushed = await admin.push(tinymodel.build_lora(tmp_path / "c", seed=2), "c")
            out = await admin.load("fake", "c", source="object", ref="c")
            assert out.replies[0].adapter.sha256 == pushed.sha256, out
            assert (await admin.unload("fake", "c")).replies[0].action == "unloaded"
            bad = await admin.load("fake", "b", source="path", ref="/etc")
            assert isinstance(bad.replies[0], ControlFailed) and bad.rolled_back
            assert bad.replies[0].code == ErrorCode.ADAPTER_NOT_ALLOWED
            async with inproc_worker(nats_url, engines[1], namespace=namespace, lora=settings) as w2:
                with anyio.fail_after(10):
                    while "a" not in w2.reports.adapters:
                        await anyio.sleep(0.05)
                assert w1.reports.adapters == ["a"]
                out = await admin.unload("fake", "a")
                assert sorted(r.action for r in out.replies if isinstance(r, AdapterReply)) == [
                    "unloaded",
                    "unloaded",
                ]
                assert engines[0].adapters == engines[1].adapters == {}


async def test_a_job_naming_an_adapter_as_its_model_runs_only_on_a_worker_holding_it(
    nats_url, namespace, tmp_path
):
    """The adapter's own queue: workers pull from it only while they hold the adapter."""
    from jetllm.producer import Client

    from .fake_engine import FakeEngine

    allowed = tmp_path / "allowed"
    tinymodel.build_lora(allowed / "a", seed=1)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=5)
    with_lora, without = FakeEngine(), FakeEngine()
    with_lora.facts.lora = TINY_FACTS
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        async with (
            inproc_worker(nats_url, with_lora, namespace=namespace, lora=settings) as holder,
            inproc_worker(nats_url, without, namespace=namespace, lora=settings),
        ):
            with anyio.fail_after(10):
                while not (await admin.list("fake")).replies:
                    await anyio.sleep(0.05)
            await admin.load("fake", "a", source="path", ref=str(allowed / "a"))
            with anyio.fail_after(10):
                while not holder.adapter_queues.serves("a"):
                    await anyio.sleep(0.05)
            done = []
            async with anyio.create_task_group() as tg:
                for i in range(6):

                    async def one(i=i) -> None:
                        done.append(await c.complete(req("a", [3, 4, 5 + i], max_tokens=4)))

                    tg.start_soon(one)
            assert len(done) == 6 and {d.worker for d in done} == {holder.instance}
            assert all(with_lora.ran_with[d.request_id] == "a" for d in done)
            assert not any(v == "a" for v in without.ran_with.values())

            await admin.unload("fake", "a")
            with anyio.fail_after(10):
                while holder.adapter_queues.serves("a"):
                    await anyio.sleep(0.05)


async def test_a_worker_stopped_while_it_starts_pulling_an_adapter_queue_still_stops(
    nats_url, namespace, tmp_path, monkeypatch
):
    """Loading an adapter starts a pull on its queue; a stop that lands meanwhile must not leave a
    puller behind that keeps the worker from ever exiting."""
    from jetllm.producer import Client
    from jetllm.workers import adapterqueues

    from .fake_engine import FakeEngine

    allowed = tmp_path / "allowed"
    tinymodel.build_lora(allowed / "a", seed=1)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=5)
    engine = FakeEngine()
    engine.facts.lora = TINY_FACTS
    setting_up, go_on = anyio.Event(), anyio.Event()
    real_ensure = adapterqueues.ensure_consumer

    async def slow_ensure(*args, **kwargs):
        setting_up.set()
        await go_on.wait()
        return await real_ensure(*args, **kwargs)

    monkeypatch.setattr(adapterqueues, "ensure_consumer", slow_ensure)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        async with inproc_worker(nats_url, engine, namespace=namespace, lora=settings) as w:
            with anyio.fail_after(10):
                while not (await admin.list("fake")).replies:
                    await anyio.sleep(0.05)
            await admin.load("fake", "a", source="path", ref=str(allowed / "a"))
            with anyio.fail_after(10):
                await setting_up.wait()
            w.stop()
            with anyio.fail_after(5):
                while w.state != "draining":
                    await anyio.sleep(0.01)
            go_on.set()
            with anyio.fail_after(8):  # below the 10 s after which leftovers are cancelled anyway
                while w.state != "stopped":
                    await anyio.sleep(0.05)
            assert not w.adapter_queues.serves("a")


async def test_garbage_in_the_lora_bucket_does_not_stop_the_watch(nats_url, namespace, tmp_path):
    """Keys that are no adapter's and values that do not decode are skipped: an adapter desired after
    them is still loaded by the watch alone (no verb asks for it)."""
    from jetllm.producer import Client
    from jetllm.subjects.setup import ensure_lora_bucket

    from .fake_engine import FakeEngine

    allowed = tmp_path / "allowed"
    tinymodel.build_lora(allowed / "a", seed=1)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=5)
    engine = FakeEngine()
    engine.facts.lora = TINY_FACTS
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        kv = await ensure_lora_bucket(c.js, c.names)
        await kv.put("fake._FF", b"there before the worker")
        async with inproc_worker(nats_url, engine, namespace=namespace, lora=settings) as w:
            for token, value in [
                ("_FF", b"x"),
                ("a_", b"x"),
                ("_2E_2E", b"x"),
                ("bad-utf8", b"\xa1\xff"),
                ("deep", b"\x91" * 100_000 + b"\x00"),
                ("junk", b"\xc1"),
            ]:
                await c.nc.publish(f"$KV.{c.names.lora_bucket}.fake.{token}", value)
            spec = {"v": 1, "name": "a", "source": "path", "ref": str(allowed / "a"), "version": 1}
            await kv.put(c.names.lora_key("fake", "a"), msgspec.msgpack.encode(spec))
            with anyio.fail_after(10):
                while "a" not in w.reports.adapters:
                    await anyio.sleep(0.05)
            await c.complete(req("fake", adapter="a"))
