"""A worker's LoRA adapters: reconciled to the model's desired set, one load per adapter at a time.

Every change of the desired set (desired.py) is reconciled as it is read, so adapters loaded
before this worker started are loaded here too. The verbs (`lora-load`, `lora-unload`,
`lora-list`) reconcile one adapter now and answer with what this instance did. The engine only
gets a held, validated copy (copies.py); a failed load is remembered per desired revision and not
retried until the key changes.

An adapter's engine identity is (name@hash, id from name and hash, path of its cached copy): vLLM
keys its prefix cache by the adapter's name and path, so new weights under the same name never
reuse blocks computed with the old ones.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ...errors import EngineRequestError
from ...schemas import (
    AdapterList,
    AdapterReply,
    AdapterSpec,
    ErrorCode,
    GenerateRequest,
    LoadedAdapter,
    LoraLoad,
    LoraUnload,
)
from ...tinymodel import default_cache_dir
from ..control import ControlError
from ..engine import Engine, EngineAdapter
from . import copies
from .cache import Held
from .desired import DesiredSet
from .files import AdapterFiles
from .jobadapter import lora_disabled, runs_with, still_loading
from .modelnames import refuse_model_name

if TYPE_CHECKING:
    from ..context import WorkerContext

log = logging.getLogger(__name__)


class LoraSettings(msgspec.Struct, kw_only=True):
    dirs: list[str] = []
    """Directories path sources may come from (realpath inside one of them); none: path sources refused."""
    cache_dir: str | None = None
    """Where verified copies live, by content hash (default: jetllm's cache directory)."""
    allow_hub: bool = False
    cache_max_bytes: int = 10 << 30
    """Copies nobody on this host uses are removed, oldest use first, above this size (0: never)."""
    load_wait: float = 60.0
    """How long a job for an adapter that is still being loaded here waits for it."""


def adapter_id(name: str, sha256: str) -> int:
    """vLLM's int id for these weights under this name: the same on every worker, new for new weights."""
    return int.from_bytes(hashlib.sha256(f"{name}\0{sha256}".encode()).digest()[:4], "big") % (2**31 - 1) + 1


class _Loaded(msgspec.Struct, kw_only=True):
    info: LoadedAdapter
    engine: EngineAdapter
    revision: int
    """The desired revision this load satisfies."""
    action: str
    """What reconciling that revision did (every caller asking about it hears the same)."""
    held: Held
    """Keeps the cached copy from being pruned while the engine may read it."""


class LoraManager:
    def __init__(
        self,
        ctx: WorkerContext,
        engine: Engine,
        settings: LoraSettings,
        *,
        retire_wait: float,
        spawn: Callable[..., None],
        on_change: Callable[[list[str]], None],
    ) -> None:
        """`retire_wait`: how long old weights wait for the requests using them before removal;
        `spawn`: starts a background step; `on_change`: told the loaded adapters after each change."""
        self._ctx = ctx
        self._engine = engine
        self._retire_wait = retire_wait
        self._spawn = spawn
        self._on_change = on_change
        self.facts = engine.facts.lora
        self.settings = settings
        cache = Path(settings.cache_dir) if settings.cache_dir else default_cache_dir() / "adapters"
        self.files = AdapterFiles(
            ctx.js, ctx.names, cache, [Path(d) for d in settings.dirs], allow_hub=settings.allow_hub
        )
        self._desired = DesiredSet(
            ctx.js, ctx.names, ctx.model, replicas=ctx.policy.replicas, on_unreadable=self._record_failure
        )
        self._loaded: dict[str, _Loaded] = {}
        self._failed: dict[str, tuple[int, ErrorCode, str]] = {}
        self._unloaded: dict[str, int] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._slots = anyio.Lock()
        self._users: dict[int, int] = {}
        self._changed = anyio.Event()

    @property
    def enabled(self) -> bool:
        """Whether the engine runs with LoRA (then `watch` runs for the worker's life)."""
        return self.facts is not None

    async def watch(self) -> None:
        await self._desired.watch(self._reconcile_quietly)

    def _record_failure(self, name: str, revision: int, code: ErrorCode, message: str) -> None:
        self._failed[name] = (revision, code, message)

    # reconciling

    async def _reconcile_quietly(self, name: str) -> None:
        try:
            await self.reconcile(name)
        except ControlError as exc:
            log.warning("adapter %r not loaded: %s: %s", name, exc.code.value, exc.message)
        except Exception:
            log.exception("adapter %r: reconcile failed", name)

    async def reconcile(self, name: str) -> AdapterReply:
        lock = self._locks.setdefault(name, anyio.Lock())
        async with lock:
            try:
                return await self._reconcile(name)
            finally:
                self._changed.set()
                self._changed = anyio.Event()

    async def _reconcile(self, name: str) -> AdapterReply:
        revision, spec = self._desired.get(name)
        failed = self._failed.get(name)
        if failed is not None and failed[0] == revision:
            raise ControlError(failed[2], code=failed[1])
        cur = self._loaded.get(name)
        if spec is None:
            return await self._unload(name, revision, cur)
        if cur is not None and cur.revision == revision:
            return self._reply(name, cur.action, cur.info)
        try:
            await refuse_model_name(self._ctx.js, self._ctx.names, self._ctx.model, name)
            return await self._load(name, revision, spec, cur)
        except ControlError as exc:
            self._failed[name] = (revision, exc.code, exc.message)
            raise
        except Exception as exc:  # remembered too: jobs naming it fail now, not after load_wait
            log.exception("adapter %r: load failed", name)
            message = (
                f"adapter {name!r}: load failed: {type(exc).__name__}: {exc}; "
                "run `jetllm lora load` again to retry"
            )
            self._failed[name] = (revision, ErrorCode.INTERNAL, message)
            raise ControlError(message, code=ErrorCode.INTERNAL) from exc

    async def _unload(self, name: str, revision: int, cur: _Loaded | None) -> AdapterReply:
        self._failed.pop(name, None)
        if cur is None:
            return self._reply(name, "unloaded" if self._unloaded.get(name) == revision else "absent")
        self._unloaded[name] = revision
        self._loaded.pop(name)
        self._published()
        await self._retire(cur)
        log.info("adapter %r unloaded", name)
        return self._reply(name, "unloaded", cur.info)

    async def _load(self, name: str, revision: int, spec: AdapterSpec, cur: _Loaded | None) -> AdapterReply:
        assert self.facts is not None
        if cur is not None and spec.sha256 is not None and cur.info.sha256 == spec.sha256:
            return self._unchanged(name, revision, spec, cur)
        path, sha, held = await copies.fetch(self.files, name, spec)
        try:
            if cur is not None and cur.info.sha256 == sha:
                held.release()  # the loaded copy is held already
                return self._unchanged(name, revision, spec, cur)
            await copies.check(name, path, self.facts)
            engine = EngineAdapter(name=f"{name}@{sha[:12]}", id=adapter_id(name, sha), path=str(path))
            async with self._slots:
                if cur is None and len(self._loaded) >= self.facts.capacity:
                    raise ControlError(
                        f"adapter {name!r}: this instance holds {len(self._loaded)} adapters, its "
                        f"limit (--max-loras) is {self.facts.capacity}; unload one first",
                        code=ErrorCode.NO_ADAPTER_SLOT,
                    )
                try:
                    await self._engine.add_adapter(engine)
                except EngineRequestError as exc:
                    raise ControlError(
                        f"adapter {name!r}: {exc.message}", code=ErrorCode.ADAPTER_INVALID
                    ) from None
                self._ctx.counters.lora_loads += 1  # idempotent calls do not count
                info = LoadedAdapter(
                    name=name,
                    sha256=sha,
                    lora_id=engine.id,
                    source=spec.source,
                    version=spec.version,
                    loaded_at=time.time(),
                )
                action = "reloaded" if cur else "loaded"
                self._loaded[name] = _Loaded(
                    info=info, engine=engine, revision=revision, action=action, held=held
                )
                self._failed.pop(name, None)
        except BaseException:  # not loaded: the copy is free to go
            held.release()
            raise
        self._published()
        log.info("adapter %r %s: sha256 %s, lora id %d", name, action, sha[:12], engine.id)
        if cur is not None:
            await self._retire(cur)
        self._spawn(copies.prune_cache, self.files.cache_dir, self.settings.cache_max_bytes)
        return self._reply(name, action, info)

    def _unchanged(self, name: str, revision: int, spec: AdapterSpec, cur: _Loaded) -> AdapterReply:
        cur.revision = revision
        cur.action = "unchanged"
        cur.info.version = spec.version
        self._failed.pop(name, None)
        return self._reply(name, "unchanged", cur.info, "already loaded with these weights")

    async def _retire(self, old: _Loaded) -> None:
        """Remove old weights from the engine once no running request uses them (bounded wait)."""
        with anyio.move_on_after(self._retire_wait):
            while self._users.get(old.engine.id):
                await self._changed.wait()
        try:
            await self._engine.remove_adapter(old.engine.id)
        finally:
            old.held.release()

    def _published(self) -> None:
        self._on_change(sorted(self._loaded))

    def _reply(
        self, name: str, action: Any, info: LoadedAdapter | None = None, detail: str = ""
    ) -> AdapterReply:
        return AdapterReply(
            instance=self._ctx.instance, name=name, action=action, adapter=info, detail=detail
        )

    # verbs

    def _require_lora(self) -> None:
        if self.facts is None:
            raise ControlError(
                "this worker runs without LoRA (start it with --enable-lora)", code=ErrorCode.LORA_DISABLED
            )

    async def on_load(self, msg: LoraLoad) -> AdapterReply:
        self._require_lora()
        await self._desired.refresh(msg.name)
        return await self.reconcile(msg.name)

    async def on_unload(self, msg: LoraUnload) -> AdapterReply:
        self._require_lora()
        await self._desired.refresh(msg.name)
        return await self.reconcile(msg.name)

    async def on_list(self, _: None) -> AdapterList:
        self._require_lora()
        assert self.facts is not None
        return AdapterList(
            instance=self._ctx.instance,
            adapters=[self._loaded[n].info for n in sorted(self._loaded)],
            capacity=self.facts.capacity,
            failed={n: f"{code.value}: {message}" for n, (_, code, message) in sorted(self._failed.items())},
        )

    # requests

    @asynccontextmanager
    async def use(self, req: GenerateRequest) -> AsyncIterator[EngineAdapter | None]:
        """The engine adapter a request runs with, held in use while it runs."""
        if req.adapter is None:
            yield None
            return
        adapter = await self._resolve(req.adapter)
        self._users[adapter.id] = self._users.get(adapter.id, 0) + 1
        try:
            yield adapter
        finally:
            self._users[adapter.id] -= 1
            if not self._users[adapter.id]:
                del self._users[adapter.id]
                self._changed.set()
                self._changed = anyio.Event()

    async def _resolve(self, name: str) -> EngineAdapter:
        if self.facts is None:
            raise lora_disabled(name, self._ctx.model)
        with anyio.move_on_after(self.settings.load_wait) as scope:
            await self._desired.synced.wait()
            while True:
                cur = self._loaded.get(name)
                adapter = runs_with(
                    name,
                    self._desired.get(name),
                    (cur.revision, cur.engine) if cur is not None else None,
                    self._failed.get(name),
                    kept=name in self._desired.kept,
                    model=self._ctx.model,
                    instance=self._ctx.instance,
                )
                if adapter is not None:
                    return adapter
                await self._changed.wait()
        assert scope.cancelled_caught
        raise still_loading(name, self._ctx.instance, self.settings.load_wait)
