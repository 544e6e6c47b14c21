"""LoRA lifecycle on the message plane (fake engine): desired state, reconcile, typed errors.
The engine-facing behaviour is checked against real vLLM in test_vllm_lora.py."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import anyio
import msgspec
import pytest

from jetllm import tinymodel
from jetllm.adapterfiles import AdapterFileError
from jetllm.errors import RequestFailed
from jetllm.producer.lora import LoraAdmin
from jetllm.producer.registry import model_cards
from jetllm.schemas import AdapterReply, ControlFailed, ErrorCode, LoraLoad
from jetllm.subjects import codec
from jetllm.workers.engine import LoraFacts
from jetllm.workers.lora import LoraSettings, copies
from jetllm.workers.lora.files import AdapterFiles
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


def adapter_a(tmp_path: Path, load_wait: float) -> LoraSettings:
    """A worker's LoRA settings whose one allowed directory holds adapter `a`."""
    allowed = tmp_path / "allowed"
    tinymodel.build_lora(allowed / "a", seed=1)
    return LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=load_wait)


def path_spec(tmp_path: Path, **fields) -> dict:
    """Adapter `a`'s desired state as `jetllm lora load --path` writes it, with `fields` over it."""
    return {"v": 1, "name": "a", "source": "path", "ref": str(tmp_path / "allowed" / "a"), **fields}


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

    settings = adapter_a(tmp_path, load_wait=5)
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
            out = await admin.load("fake", "a", source="path", ref=str(tmp_path / "allowed" / "a"))
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

    settings = adapter_a(tmp_path, load_wait=5)
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
            await admin.load("fake", "a", source="path", ref=str(tmp_path / "allowed" / "a"))
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

    settings = adapter_a(tmp_path, load_wait=5)
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
            await admin.load("fake", "a", source="path", ref=str(tmp_path / "allowed" / "a"))
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

    settings = adapter_a(tmp_path, load_wait=5)
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
            spec = path_spec(tmp_path, version=1)
            await kv.put(c.names.lora_key("fake", "a"), msgspec.msgpack.encode(spec))
            with anyio.fail_after(10):
                while "a" not in w.reports.adapters:
                    await anyio.sleep(0.05)
            await c.complete(req("fake", adapter="a"))


def _weights(header: dict | str, data: int = 0) -> bytes:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * data


_HUGE = "9" * 5000
_A_BYTES = 8 * 256 * 4
_LAYER_KEY = f"base_model.model.layers.{_HUGE}.self_attn.q_proj.lora_A.weight"


def test_files_that_break_json_or_int_limits_are_invalid_not_internal(tmp_path: Path):
    """Anyone can write an adapter's files: json's own limits must end as ADAPTER_INVALID naming the file."""
    cases = {
        "config-big-int": ("adapter_config.json", ('{"r": ' + "1" * 5000 + "}").encode(), "not usable JSON"),
        "config-deep": ("adapter_config.json", b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        "header-big-int": (
            "adapter_model.safetensors",
            _weights('{"t": {"dtype": "F32", "shape": [' + _HUGE + '], "data_offsets": [0, 4]}}', 4),
            "header of adapter_model.safetensors is not usable JSON",
        ),
        "header-deep": (
            "adapter_model.safetensors",
            struct.pack("<Q", 400_000) + b"[" * 200_000 + b"]" * 200_000,
            "header of adapter_model.safetensors is nested too deeply",
        ),
        "header-inf-shape": (
            "adapter_model.safetensors",
            _weights({"t": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}, 4),
            "is corrupt",
        ),
        "layer-index": (
            "adapter_model.safetensors",
            _weights(
                {_LAYER_KEY: {"dtype": "F32", "shape": [8, 256], "data_offsets": [0, _A_BYTES]}}, _A_BYTES
            ),
            "has a layer index of 5000 digits; the model has 2 layers",
        ),
    }
    for name, (file, content, message) in cases.items():
        d = tinymodel.build_lora(tmp_path / name)
        (d / file).write_bytes(content)
        with pytest.raises(AdapterFileError) as info:
            validate(d, TINY_FACTS)
        assert info.value.code == ErrorCode.ADAPTER_INVALID and message in info.value.message, (
            name,
            info.value,
        )
        assert len(info.value.message) < 1000, name  # a 5000-digit name is cut to fit a reply
    files = AdapterFiles(None, None, tmp_path / "cache", [tmp_path])  # type: ignore[arg-type]
    with pytest.raises(AdapterFileError) as info:
        files._checked_path(f"{tmp_path}/x\x00y")
    assert info.value.code == ErrorCode.ADAPTER_NOT_ALLOWED and "not a usable path" in info.value.message


_load_reply = codec.Decoder(AdapterReply | ControlFailed)


async def _lora_load(c, instance: str, name: str) -> AdapterReply | ControlFailed:
    msg = await c.nc.request(
        c.names.instance_control(instance, "lora-load"), codec.encode(LoraLoad(name=name)), timeout=10
    )
    return _load_reply.decode(msg.data)


async def _lora_worker_ready(admin: LoraAdmin) -> None:
    with anyio.fail_after(10):
        while not (await admin.list("fake")).replies:
            await anyio.sleep(0.05)


def _raises(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc

    return fail


async def test_a_bad_adapter_fails_its_load_typed_and_lora_list_and_jobs_say_why(
    nats_url, namespace, tmp_path
):
    """Whatever is wrong with an adapter's desired state or files, the verb answers a typed error
    naming it, lora-list shows it under `failed`, and a job naming the adapter fails with it at once
    (not with "still loading" after load_wait)."""
    from jetllm.producer import Client
    from jetllm.subjects.setup import ensure_lora_bucket

    from .fake_engine import FakeEngine

    allowed = tmp_path / "allowed"
    for name in ("big", "deep", "locked", "bug"):
        tinymodel.build_lora(allowed / name, seed=1)
    (allowed / "big" / "adapter_config.json").write_text('{"r": ' + "1" * 5000 + "}")
    (allowed / "deep" / "adapter_config.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=3)
    engine = FakeEngine()
    engine.facts.lora = TINY_FACTS

    def path(name: str, **extra) -> dict:
        return {"v": 1, "name": name, "source": "path", "ref": str(allowed / name), **extra}

    cases = [  # name, spec, patched (copies attribute, replacement), code, message
        ("nul", {**path("nul"), "ref": f"{allowed}/x\x00y"}, None, ErrorCode.INVALID_REQUEST, "`$.ref`"),
        ("newer", path("newer", priority=1), None, ErrorCode.INVALID_REQUEST, "$.priority: Object contains unknown"),
        ("big", path("big"), None, ErrorCode.ADAPTER_INVALID, "adapter_config.json is not usable JSON"),
        ("deep", path("deep"), None, ErrorCode.ADAPTER_INVALID, "adapter_config.json is nested too deeply"),
        ("manifest", {"v": 1, "name": "manifest", "source": "object", "ref": "manifest"}, None,
         ErrorCode.ADAPTER_INVALID, "its manifest in the adapters object store cannot be read"),
        ("locked", path("locked"), ("hold", _raises(PermissionError(13, "Permission denied"))),
         ErrorCode.ADAPTER_NOT_FOUND, "its cached copy cannot be locked"),
        ("bug", path("bug"), ("validate", _raises(RuntimeError("boom"))), ErrorCode.INTERNAL, "RuntimeError: boom"),
    ]  # fmt: skip
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        kv = await ensure_lora_bucket(c.js, c.names)
        store = await c.js.create_object_store(c.names.adapters_store)
        await store.put(c.names.adapter_manifest("manifest"), b"\xc1 not a manifest")
        async with inproc_worker(nats_url, engine, namespace=namespace, lora=settings) as w:
            await _lora_worker_ready(admin)
            for name, spec, patched, code, message in cases:
                with pytest.MonkeyPatch.context() as mp:
                    if patched:
                        mp.setattr(copies, *patched)
                    await kv.put(c.names.lora_key("fake", name), msgspec.msgpack.encode(spec))
                    reply = await _lora_load(c, w.instance, name)
                assert isinstance(reply, ControlFailed), (name, reply)
                assert reply.code == code and message in reply.message, (name, reply)
                (listed,) = (await admin.list("fake")).replies
                assert listed.failed[name] == f"{code.value}: {reply.message}", (name, listed)
                with pytest.raises(RequestFailed) as info:
                    await c.complete(req("fake", adapter=name))
                assert info.value.code == ErrorCode.ADAPTER_NOT_LOADED, name
                assert f"failed to load on {w.instance}: {code.value}" in str(info.value), (name, info.value)
            assert engine.adapters == {}


async def test_an_unreadable_desired_state_keeps_the_loaded_adapter(nats_url, namespace, tmp_path):
    """A key written by a newer jetllm (a field this worker does not know) is refused, naming the
    field; the adapter is not unloaded as if its key had been deleted, and goes on serving."""
    from jetllm.producer import Client
    from jetllm.subjects.setup import ensure_lora_bucket

    from .fake_engine import FakeEngine

    settings = adapter_a(tmp_path, load_wait=3)
    engine = FakeEngine()
    engine.facts.lora = TINY_FACTS
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        kv = await ensure_lora_bucket(c.js, c.names)
        async with inproc_worker(nats_url, engine, namespace=namespace, lora=settings) as w:
            await _lora_worker_ready(admin)
            await admin.load("fake", "a", source="path", ref=str(tmp_path / "allowed" / "a"))
            loaded = dict(engine.adapters)
            spec = path_spec(tmp_path, version=2, priority=1)
            await kv.put(c.names.lora_key("fake", "a"), msgspec.msgpack.encode(spec))
            reply = await _lora_load(c, w.instance, "a")
            assert isinstance(reply, ControlFailed) and reply.code == ErrorCode.INVALID_REQUEST, reply
            assert "$.priority: Object contains unknown field `priority`" in reply.message, reply
            assert engine.adapters == loaded and w.reports.adapters == ["a"]
            (listed,) = (await admin.list("fake")).replies
            assert [a.name for a in listed.adapters] == ["a"] and "$.priority" in listed.failed["a"]
            # its jobs still run here (in a rolling upgrade, newer workers serve the new spec)
            with anyio.fail_after(10):
                await c.complete(req("fake", adapter="a"))
            del spec["priority"]
            await kv.put(c.names.lora_key("fake", "a"), msgspec.msgpack.encode({**spec, "version": 3}))
            reply = await _lora_load(c, w.instance, "a")  # readable again, and the same weights
            assert isinstance(reply, AdapterReply) and reply.action == "unchanged", reply
            await c.complete(req("fake", adapter="a"))


async def test_an_adapter_named_like_a_served_model_is_refused(nats_url, namespace, tmp_path):
    """Jobs naming an adapter as their model share the queue of a model by that name: an adapter
    named like this worker's model, or like a model another instance serves, would take that
    model's jobs, so its load is refused naming `$.name`."""
    from jetllm.producer import Client

    from .fake_engine import FakeEngine

    allowed = tmp_path / "allowed"
    tinymodel.build_lora(allowed / "x", seed=1)
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=3)
    engine = FakeEngine(model="fake")
    engine.facts.lora = TINY_FACTS
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        admin = LoraAdmin(c.nc, c.names, timeout=10)
        async with (
            inproc_worker(nats_url, engine, namespace=namespace, lora=settings) as w,
            inproc_worker(nats_url, FakeEngine(model="other"), namespace=namespace) as other,
        ):
            await _lora_worker_ready(admin)
            with anyio.fail_after(10):
                while "other" not in {card.model for card in await model_cards(c.js, c.names)}:
                    await anyio.sleep(0.05)
            for name in ("fake", "other"):
                out = await admin.load("fake", name, source="path", ref=str(allowed / "x"))
                (refused,) = out.replies
                assert isinstance(refused, ControlFailed) and refused.code == ErrorCode.INVALID_REQUEST, out
                assert refused.message.startswith(f"$.name: adapter {name!r} has the name of a model"), out
                assert out.rolled_back and engine.adapters == {} and not w.adapter_queues.serves(name)
            assert (await c.complete(req("other", [3, 4, 5]))).worker == other.instance
            plain = await c.complete(req("fake", [3, 4, 5]))
            assert plain.worker == w.instance and engine.ran_with[plain.request_id] is None


async def test_a_queue_pulled_already_gets_no_second_puller(nats_url, namespace):
    """A second puller for one consumer would be untracked: never stopped, it would keep taking
    jobs through a drain."""
    from .fake_engine import FakeEngine

    async with inproc_worker(nats_url, FakeEngine(), namespace=namespace) as w:
        pulling = dict(w.pulls._pullers)
        assert pulling
        for consumer in pulling:
            assert w.pulls.start(consumer) is None
        assert w.pulls._pullers == pulling
