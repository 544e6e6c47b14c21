"""LoRA adapters from the producer's side: push adapter files, and change the set of adapters a
model serves.

The set lives in the LoRA bucket (one key per model and adapter); every worker of the model
watches its keys and loads or unloads to match, so a worker that starts later gets them too.
`load` and `unload` write the key and then ask the model's workers (or one instance) to reconcile
that adapter now, collecting one reply per instance. If every instance that answered failed a
load, the key goes back to what it was: a bad adapter does not linger in the desired state.
"""

from __future__ import annotations

import builtins
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from ..adapterfiles import (
    ADAPTER_FILES,
    CONFIG,
    WEIGHTS,
    combined_sha256,
    digests,
    read_config,
    read_safetensors_header,
)
from ..errors import JetllmError
from ..schemas import (
    AdapterList,
    AdapterManifest,
    AdapterReply,
    AdapterSource,
    AdapterSpec,
    ControlFailed,
    ErrorCode,
    LoraLoad,
    LoraUnload,
)
from ..subjects import codec
from ..subjects.kvsnapshot import entries_matching
from ..subjects.names import Names
from ..subjects.setup import ensure_bucket, ensure_lora_bucket, namespace_replicas
from .fleet import gather
from .registry import instances

_spec = codec.Decoder(AdapterSpec)
_manifest = codec.Decoder(AdapterManifest)
_change_reply = codec.Decoder(AdapterReply | ControlFailed)
_list_reply = codec.Decoder(AdapterList | ControlFailed)


class AdapterError(JetllmError):
    """A LoRA command failed before any worker was asked."""


async def ensure_adapters_store(
    js: JetStreamContext, names: Names, *, replicas: int | None = None
) -> ObjectStore:
    """The adapter files; `replicas` None follows the namespace (subjects/setup.py)."""
    return await ensure_bucket(
        js,
        ObjectStoreConfig(
            bucket=names.adapters_store,
            description="jetllm: LoRA adapter files",
            storage=StorageType.FILE,
            replicas=replicas or await namespace_replicas(js, names),
        ),
    )


@dataclass
class FanOut:
    """The replies of one verb: one per instance that answered in time."""

    replies: list[Any] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Instances of the model (from the registry) that did not answer in time."""
    rolled_back: bool = False
    """Every instance failed the load, so the desired state was put back as it was."""

    @property
    def failed(self) -> list[ControlFailed]:
        return [r for r in self.replies if isinstance(r, ControlFailed)]


class LoraAdmin:
    def __init__(self, nc: NATS, names: Names, *, timeout: float = 120.0) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10)
        self.names = names
        self.timeout = timeout

    async def push(self, directory: Path, name: str) -> AdapterManifest:
        """Upload an adapter's files under their content hash and name them `name`."""
        directory = Path(directory)
        try:
            msgspec.convert({"name": name, "source": "object", "ref": name}, AdapterSpec)
        except msgspec.ValidationError as exc:
            raise AdapterError(f"bad adapter name {name!r}: {exc}", code=ErrorCode.INVALID_REQUEST) from None
        files = await anyio.to_thread.run_sync(_checked_digests, directory)
        sha = combined_sha256(files)
        store = await ensure_adapters_store(self.js, self.names)
        size = 0
        for file in ADAPTER_FILES:
            size += (directory / file).stat().st_size
            with open(directory / file, "rb") as f:
                await store.put(self.names.adapter_file(sha, file), f)
        manifest = AdapterManifest(name=name, sha256=sha, files=files, size=size, pushed_at=time.time())
        await store.put(self.names.adapter_manifest(name), codec.encode(manifest))
        return manifest

    async def load(
        self,
        model: str,
        name: str,
        *,
        source: AdapterSource,
        ref: str,
        sha256: str | None = None,
        instance: str | None = None,
    ) -> FanOut:
        if source == "object" and sha256 is None:
            sha256 = (await self.manifest(ref)).sha256
        kv = await ensure_lora_bucket(self.js, self.names)
        key = self.names.lora_key(model, name)
        prev = await _get(kv, key)
        version = (_spec.decode(prev.value).version + 1) if prev is not None and prev.value else 1
        try:
            spec = msgspec.convert(
                {
                    "name": name,
                    "source": source,
                    "ref": ref,
                    "sha256": sha256,
                    "version": version,
                    "updated_at": time.time(),
                },
                AdapterSpec,
            )
        except msgspec.ValidationError as exc:
            raise AdapterError(f"bad adapter: {exc}", code=ErrorCode.INVALID_REQUEST) from None
        revision = await kv.put(key, codec.encode(spec))
        out = await self._ask(
            model, "lora-load", LoraLoad(name=name, version=version), _change_reply, instance
        )
        if out.replies and len(out.failed) == len(out.replies):
            out.rolled_back = await _restore(kv, key, prev, revision)
        return out

    async def unload(self, model: str, name: str, *, instance: str | None = None) -> FanOut:
        kv = await ensure_lora_bucket(self.js, self.names)
        await kv.delete(self.names.lora_key(model, name))
        return await self._ask(model, "lora-unload", LoraUnload(name=name), _change_reply, instance)

    async def list(self, model: str, *, instance: str | None = None) -> FanOut:
        return await self._ask(model, "lora-list", None, _list_reply, instance, timeout=5.0)

    async def desired(self, model: str) -> builtins.list[AdapterSpec]:  # `list` is a method here
        kv = await ensure_lora_bucket(self.js, self.names)
        keys = [e.key for e in await entries_matching(kv, self.names.lora_keys_of(model), meta_only=True)]
        specs = []
        for key in keys:
            entry = await _get(kv, key)
            if entry is not None and entry.value:
                specs.append(_spec.decode(entry.value))
        return sorted(specs, key=lambda s: s.name)

    async def manifest(self, name: str) -> AdapterManifest:
        try:
            store = await self.js.object_store(self.names.adapters_store)
            found = await store.get(self.names.adapter_manifest(name))
        except (
            nats.js.errors.NotFoundError,
            nats.js.errors.ObjectNotFoundError,
            nats.js.errors.BucketNotFoundError,
            nats.js.errors.ObjectDeletedError,
        ):
            raise AdapterError(
                f"no adapter {name!r} in the adapters object store; `jetllm lora push` it first",
                code=ErrorCode.ADAPTER_NOT_FOUND,
            ) from None
        return _manifest.decode(found.data)  # type: ignore[arg-type]  # nats-py: data Optional

    async def _ask(
        self,
        model: str,
        verb: str,
        body: msgspec.Struct | None,
        decoder: codec.Decoder,
        instance: str | None,
        timeout: float | None = None,
    ) -> FanOut:
        if instance is not None:
            subject, expected = self.names.instance_control(instance, verb), {instance}
        else:
            subject = self.names.model_control(model, verb)
            expected = {r.instance for r in await instances(self.js, self.names, model=model)}
        # Without a known instance, wait a short while for whoever answers.
        replies = await gather(
            self.nc,
            subject,
            codec.encode(body) if body is not None else b"",
            decoder,
            (timeout or self.timeout) if expected else 2.0,
            expected,
        )
        return FanOut(replies=replies, missing=sorted(expected - {r.instance for r in replies}))


def _checked_digests(directory: Path) -> dict[str, str]:
    files = digests(directory)
    read_config(directory / CONFIG)
    read_safetensors_header(directory / WEIGHTS)
    return files


async def _get(kv: KeyValue, key: str) -> KeyValue.Entry | None:
    try:
        return await kv.get(key)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None


async def _restore(kv: KeyValue, key: str, prev: KeyValue.Entry | None, revision: int) -> bool:
    """Put the key back as it was, unless someone wrote it since."""
    try:
        if prev is not None and prev.value:
            await kv.update(key, prev.value, last=revision)
        else:
            await kv.delete(key, last=revision)
    except nats.js.errors.KeyWrongLastSequenceError:
        return False
    return True
