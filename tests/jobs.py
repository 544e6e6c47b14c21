"""Helpers shared by the tests: raw job publishing, frame collection, dead-letter reading."""

from __future__ import annotations

import uuid

import anyio
import msgspec
from nats.aio.client import Client as NATS

from jetllm.producer.traces import trace_records
from jetllm.schemas import (
    DeadLetter,
    Frame,
    GenerateRequest,
    SamplingOptions,
    StopConditions,
    TokensPrompt,
)
from jetllm.subjects import codec
from jetllm.subjects.names import Names


def req(model: str, prompt: list[int] | None = None, max_tokens: int = 8, **kw) -> GenerateRequest:
    return GenerateRequest(
        request_id=kw.pop("request_id", f"r-{uuid.uuid4().hex}"),
        model=model,
        prompt=TokensPrompt(prompt or [5, 6, 7]),
        sampling=kw.pop("sampling", SamplingOptions(temperature=0)),
        stop=kw.pop("stop", StopConditions(max_tokens=max_tokens, ignore_eos=True)),
        **kw,
    )


class RawInbox:
    """A producer that publishes raw bytes (like the `nats` CLI) and reads frames on its own inbox."""

    def __init__(self, nc: NATS, encoding: codec.Encoding = "msgpack") -> None:
        self.nc = nc
        self.subject = f"_INBOX.raw.{uuid.uuid4().hex}"
        self.encoding = encoding
        self.frames: list[Frame] = []
        self._sub = None

    async def __aenter__(self) -> RawInbox:
        self._sub = await self.nc.subscribe(self.subject)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._sub.unsubscribe()

    async def until_end(self, timeout: float = 30.0) -> list[Frame]:
        with anyio.fail_after(timeout):
            while True:
                msg = await self._sub.next_msg(timeout=timeout)
                frame = codec.frame_decoder.decode(msg.data, self.encoding)
                self.frames.append(frame)
                if type(frame).__name__ in ("FinalFrame", "ErrorFrame"):
                    return self.frames


async def publish_raw(nc: NATS, names: Names, model: str, data: bytes, headers: dict | None = None) -> None:
    ack = await nc.jetstream().publish(names.jobs("generate", model), data, headers=headers)
    assert ack.stream == names.jobs_stream


async def dead_letters(nc: NATS, names: Names) -> list[DeadLetter]:
    js = nc.jetstream()
    info = await js.stream_info(names.dlq_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            raw = await js.get_msg(names.dlq_stream, seq)
        except Exception:
            continue
        out.append(msgspec.msgpack.decode(raw.data, type=DeadLetter))
    return out


async def wait_dead_letter(nc: NATS, names: Names, predicate, timeout: float = 15.0) -> DeadLetter:
    with anyio.fail_after(timeout):
        while True:
            for d in await dead_letters(nc, names):
                if predicate(d):
                    return d
            await anyio.sleep(0.05)


async def consumer_counts(nc: NATS, names: Names, model: str) -> tuple[int, int]:
    """(jobs waiting in JetStream, jobs delivered and not yet acked) for the model's consumer."""
    info = await nc.jetstream().consumer_info(names.jobs_stream, names.consumer("generate", model))
    return info.num_pending, info.num_ack_pending


async def kv_batches(
    nc: NATS,
    names: Names,
    model: str,
    instance: str,
    until,
    start_seq: int | None = None,
    timeout: float = 30,
) -> list:
    """An instance's KV-event batches in the stream, read again until `until(batches)` holds."""
    from jetllm.producer.kvevents import kv_events

    with anyio.fail_after(timeout):
        while True:
            got = [
                d.batch
                async for d in kv_events(
                    nc, names, model, instance=instance, start_seq=start_seq, follow=False
                )
            ]
            if until(got):
                return got
            await anyio.sleep(0.05)


def kv_blocks(events) -> dict[int, list[int]]:
    """Block hash -> its tokens, after applying KV events in order."""
    from jetllm.schemas import KvCleared, KvRemoved, KvStored

    live: dict[int, list[int]] = {}
    for ev in events:
        if isinstance(ev, KvStored):
            for i, h in enumerate(ev.block_hashes):
                live[h] = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
        elif isinstance(ev, KvRemoved):
            for h in ev.block_hashes:
                live.pop(h, None)
        elif isinstance(ev, KvCleared):
            live.clear()
    return live


async def prefill_note(c, rid: str) -> str | None:
    """Where the request's prompt was prefilled, as its trace record says (a decode worker writes
    it once the request ends)."""
    with anyio.fail_after(10):
        while True:
            records = [r for r in await trace_records(c.js, c.names, rid) if r.request_id == rid]
            if records:
                return records[-1].prefill
            await anyio.sleep(0.05)
