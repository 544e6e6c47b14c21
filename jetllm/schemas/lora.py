"""LoRA adapters: the desired set per model (KV bucket), the verbs that change it, and the
per-instance replies."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from .common import Command, Report

AdapterName = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="Letters, digits, '.', '_', '-'; starts with a letter or digit.",
    ),
]
AdapterSource = Literal["path", "object", "hub"]
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class AdapterSpec(Command, kw_only=True):
    """One adapter a model should serve, under `<model>.<adapter>` in the LoRA bucket.

    Workers of the model watch these keys and load what is there, unload what is gone.
    """

    name: AdapterName
    source: AdapterSource
    ref: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=1024,
            pattern=r"^[^\x00-\x1f\x7f]+$",
            description="No control characters.",
        ),
    ]
    """path: a directory on the workers, inside one of their `--lora-dir`s; object: the adapter's
    name in the adapters object store (`jetllm lora push`); hub: a model hub repository id."""
    sha256: Sha256 | None = None
    """Content hash of the adapter files (see docs/fleet.md); workers refuse files that differ.
    Known at push time for object sources; None for a path or hub source: each worker hashes what it finds."""
    version: int = 1
    """Bumped on every write of this key."""
    updated_at: float = 0.0


class AdapterManifest(Command, kw_only=True):
    """What `jetllm lora push` stores under the adapter's name in the adapters object store;
    the files themselves are objects `sha256/<sha256>/<file>`."""

    name: AdapterName
    sha256: Sha256
    files: dict[str, Sha256]
    """File name -> sha256 of its bytes."""
    size: int
    pushed_at: float = 0.0


class LoraLoad(Command, kw_only=True):
    """Body of `lora-load`: reconcile this adapter to the bucket's spec (at least `version`), then reply."""

    name: AdapterName
    version: int = 0


class LoraUnload(Command, kw_only=True):
    """Body of `lora-unload`: reconcile this adapter (its key was deleted), then reply."""

    name: AdapterName


class LoadedAdapter(Report, kw_only=True):
    """An adapter as one instance runs it."""

    name: str
    sha256: str
    lora_id: int
    """vLLM's adapter id, derived from (name, sha256): new weights get a new id, so nothing
    cached for the old weights (prefix cache) is reused."""
    source: AdapterSource
    version: int = 0
    loaded_at: float = 0.0


class AdapterReply(Report, kw_only=True, tag="adapter"):
    """One instance's answer to `lora-load` or `lora-unload`."""

    instance: str
    name: str
    action: Literal["loaded", "reloaded", "unchanged", "unloaded", "absent"]
    """What this call did: loaded, reloaded (new weights under the same name), unchanged (already
    loaded with these weights), unloaded, absent (was not loaded)."""
    adapter: LoadedAdapter | None = None
    detail: str = ""


class AdapterList(Report, kw_only=True, tag="adapters"):
    """One instance's answer to `lora-list`."""

    instance: str
    adapters: list[LoadedAdapter] = []
    capacity: int = 0
    """Adapters this instance can hold at once (vLLM's max_cpu_loras)."""
    failed: dict[str, str] = {}
    """Desired adapters this instance could not load: name -> `code: message`."""
