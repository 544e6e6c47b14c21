"""A worker's LoRA adapters: reconciled to the model's desired set, one load per adapter at a time.

The desired set is the LoRA bucket's keys for this model, watched from the start, so adapters
loaded before this worker started are loaded here too. The verbs (`lora-load`, `lora-unload`,
`lora-list`) reconcile one adapter now and answer with what this instance did. Nothing reaches
the engine before its files are copied into the local cache, hashed and validated; a failed load
is remembered per desired revision and not retried until the key changes.

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
import nats.errors
import nats.js.errors

from ...adapterfiles import AdapterFileError
from ...errors import EngineRequestError, RequestRejected
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
from ...schemas.lora import AdapterName
from ...subjects import codec
from ...subjects.kvsnapshot import SnapshotEnd
from ...subjects.setup import ensure_lora_bucket
from ...tinymodel import default_cache_dir
from ..control import ControlError, naming_field
from ..engine import Engine, EngineAdapter
from .cache import Held, hold, prune
from .files import AdapterFiles
from .validate import validate

if TYPE_CHECKING:
    from ..context import WorkerContext

log = logging.getLogger(__name__)

_spec = codec.Decoder(AdapterSpec)


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
        self._desired: dict[str, tuple[int, AdapterSpec | None]] = {}
        self._loaded: dict[str, _Loaded] = {}
        self._failed: dict[str, tuple[int, ErrorCode, str]] = {}
        self._kept: set[str] = set()
        """Adapters whose newest desired state could not be read: the loaded one goes on serving."""
        self._unloaded: dict[str, int] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._slots = anyio.Lock()
        self._users: dict[int, int] = {}
        self._changed = anyio.Event()
        self._synced = anyio.Event()

    @property
    def enabled(self) -> bool:
        """Whether the engine runs with LoRA (then `watch` runs for the worker's life)."""
        return self.facts is not None

    # desired state

    async def watch(self) -> None:
        """Follow the model's keys in the LoRA bucket for the worker's life (re-watch after errors)."""
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    kv = await ensure_lora_bucket(
                        self._ctx.js, self._ctx.names, replicas=self._ctx.policy.replicas
                    )
                    keys = self._ctx.names.lora_keys_of(self._ctx.model)
                    watcher = await kv.watch(keys)
                    end = SnapshotEnd()
                    try:
                        while True:
                            try:
                                entry = await watcher.updates(timeout=5.0)
                            except (TimeoutError, nats.errors.TimeoutError):
                                if end.quiet():
                                    self._synced.set()
                                continue
                            if entry is None:
                                if await end.marker(kv, keys):
                                    self._synced.set()
                                continue
                            self._follow(entry, tg)
                            if end.entry(entry):
                                self._synced.set()
                    finally:
                        await watcher.stop()
                except Exception as exc:
                    log.warning("LoRA desired-state watch failed (%s); watching again", exc)
                    await anyio.sleep(1.0)

    def _follow(self, entry: Any, tg: Any) -> None:
        """One change of the desired set. Anyone can write the bucket: an entry that no adapter could
        have (a key that is not an encoded adapter name, a value that breaks decoding) is skipped, so
        it cannot stop the watch, which would then miss every later change."""
        try:
            name = self._ctx.names.adapter_from_key(entry.key)
            msgspec.convert(name, AdapterName)
        except (ValueError, msgspec.ValidationError) as exc:  # a UnicodeDecodeError is a ValueError
            log.warning("LoRA bucket key %r ignored: not an adapter name (%s)", entry.key, exc)
            return
        try:
            deleted = entry.operation in ("DEL", "PURGE") or not entry.value
            if self._apply(name, entry.revision, None if deleted else entry.value):
                tg.start_soon(self._reconcile_quietly, name)
        except Exception:
            log.exception("adapter %r: desired-state entry (revision %s) ignored", name, entry.revision)

    def _apply(self, name: str, revision: int, value: bytes | None) -> bool:
        last, previous = self._desired.get(name, (0, None))
        if revision <= last:
            return False
        spec = None
        self._kept.discard(name)
        if value is not None:
            try:
                spec = _spec.decode(value)
            except msgspec.DecodeError as exc:  # a ValidationError is one too
                self._unreadable(name, revision, exc)
                self._kept.add(name)
                spec = previous
        self._desired[name] = (revision, spec)
        return True

    def _unreadable(self, name: str, revision: int, exc: msgspec.DecodeError) -> None:
        """A value this worker cannot read (a field of a newer jetllm, a hand-edited key) says
        nothing about what is wanted: the adapter stays as it is and goes on serving its jobs (in
        a rolling upgrade the newer workers serve the new spec), and this revision fails, so the
        verb and `lora-list` say why instead of the adapter being unloaded."""
        code = ErrorCode.INVALID_REQUEST if isinstance(exc, msgspec.ValidationError) else ErrorCode.MALFORMED
        message = (
            f"adapter {name!r}: its desired state (revision {revision}) cannot be read: "
            f"{naming_field(exc)}; it stays as it was until the key holds a spec this version reads "
            "(or is deleted: jetllm lora unload)"
        )
        log.warning("%s", message)
        self._failed[name] = (revision, code, message)

    async def _refresh(self, name: str) -> None:
        """Read the adapter's key now: a verb must not act on a watch that lags behind its caller."""
        kv = await ensure_lora_bucket(self._ctx.js, self._ctx.names, replicas=self._ctx.policy.replicas)
        key = self._ctx.names.lora_key(self._ctx.model, name)
        try:
            entry = await kv.get(key)
            # nats-py types KeyValue.Entry.revision Optional; a fetched entry has one
            self._apply(name, entry.revision, entry.value or None)  # type: ignore[arg-type]
        except nats.js.errors.KeyDeletedError as exc:
            self._apply(name, exc.entry.revision if exc.entry else 0, None)
        except nats.js.errors.KeyNotFoundError:
            rev = self._desired.get(name, (0, None))[0]
            self._desired[name] = (rev, None)

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
        revision, spec = self._desired.get(name, (0, None))
        failed = self._failed.get(name)
        if failed is not None and failed[0] == revision:
            raise ControlError(failed[2], code=failed[1])
        cur = self._loaded.get(name)
        if spec is None:
            return await self._unload(name, revision, cur)
        if cur is not None and cur.revision == revision:
            return self._reply(name, cur.action, cur.info)
        try:
            await self._refuse_model_name(name)
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

    async def _refuse_model_name(self, name: str) -> None:
        """Jobs naming an adapter as their model go to the queue `jobs.<role>.<adapter>`, which is
        also the queue of a model by that name: this worker would take that model's jobs and run
        them with the adapter. Models are those with a card in the registry now; one started
        later under an adapter's name is not caught (docs/decisions.md)."""
        if name == self._ctx.model or await self._model_card_exists(name):
            raise ControlError(
                f"$.name: adapter {name!r} has the name of a model this fleet serves, so it would "
                "take that model's jobs; load it under another name",
                code=ErrorCode.INVALID_REQUEST,
            )

    async def _model_card_exists(self, model: str) -> bool:
        try:
            kv = await self._ctx.js.key_value(self._ctx.names.registry_bucket)
            entry = await kv.get(self._ctx.names.model_card_key(model))
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            return False  # KeyNotFoundError and KeyDeletedError are NotFoundErrors
        except nats.errors.Error as exc:  # a registry out of reach must not fail the load for good
            log.warning("adapter %r: the registry's model cards could not be read (%s)", model, exc)
            return False
        return bool(entry.value)

    async def _load(self, name: str, revision: int, spec: AdapterSpec, cur: _Loaded | None) -> AdapterReply:
        assert self.facts is not None
        if cur is not None and spec.sha256 is not None and cur.info.sha256 == spec.sha256:
            return self._unchanged(name, revision, spec, cur)
        path, sha, held = await self._fetch(name, spec)
        try:
            if cur is not None and cur.info.sha256 == sha:
                held.release()  # the loaded copy is held already
                return self._unchanged(name, revision, spec, cur)
            try:
                await anyio.to_thread.run_sync(validate, path, self.facts)
            except AdapterFileError as exc:
                raise ControlError(f"adapter {name!r}: {exc.message}", code=exc.code) from None
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
        self._spawn(self._prune)
        return self._reply(name, action, info)

    async def _fetch(self, name: str, spec: AdapterSpec) -> tuple[Path, str, Held]:
        """The verified copy, held; fetched again if a pruner on this host took it meanwhile."""
        for _ in range(3):
            try:
                path, sha = await self.files.fetch(spec)
            except AdapterFileError as exc:
                raise ControlError(f"adapter {name!r}: {exc.message}", code=exc.code) from None
            except OSError as exc:
                raise ControlError(f"adapter {name!r}: {exc}", code=ErrorCode.ADAPTER_NOT_FOUND) from None
            try:
                held = await anyio.to_thread.run_sync(hold, path)
            except OSError as exc:
                raise ControlError(
                    f"adapter {name!r}: its cached copy cannot be locked ({exc}); this worker must "
                    "be able to write its adapter cache directory (--lora-cache-dir)",
                    code=ErrorCode.ADAPTER_NOT_FOUND,
                ) from None
            if held is not None:
                return path, sha, held
        raise ControlError(
            f"adapter {name!r}: its cached copy kept being pruned", code=ErrorCode.ADAPTER_NOT_FOUND
        )

    async def _prune(self) -> None:
        if self.settings.cache_max_bytes > 0:
            try:
                removed = await anyio.to_thread.run_sync(
                    prune, self.files.cache_dir, self.settings.cache_max_bytes
                )
            except OSError as exc:  # a full or read-only disk must not take the worker down
                log.warning("adapter cache not pruned: %s", exc)
                return
            if removed:
                log.info(
                    "adapter cache over %d bytes: removed %d unused copies (%s)",
                    self.settings.cache_max_bytes,
                    len(removed),
                    ", ".join(r[:12] for r in removed),
                )

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
        await self._refresh(msg.name)
        return await self.reconcile(msg.name)

    async def on_unload(self, msg: LoraUnload) -> AdapterReply:
        self._require_lora()
        await self._refresh(msg.name)
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
            raise RequestRejected(
                ErrorCode.LORA_DISABLED,
                f"adapter {name!r}: the workers of {self._ctx.model!r} run without LoRA",
                field="$.adapter",
            )
        with anyio.move_on_after(self.settings.load_wait) as scope:
            await self._synced.wait()
            while True:
                revision, spec = self._desired.get(name, (0, None))
                kept = self._loaded.get(name) if name in self._kept else None
                if kept is not None:
                    return kept.engine
                failed = self._failed.get(name)
                if failed is not None and failed[0] == revision:
                    raise RequestRejected(
                        ErrorCode.ADAPTER_NOT_LOADED,
                        f"adapter {name!r} failed to load on {self._ctx.instance}: "
                        f"{failed[1].value}: {failed[2]}",
                        field="$.adapter",
                    )
                if spec is None:
                    raise RequestRejected(
                        ErrorCode.UNKNOWN_ADAPTER,
                        f"model {self._ctx.model!r} has no adapter {name!r} (jetllm lora list)",
                        field="$.adapter",
                    )
                cur = self._loaded.get(name)
                if cur is not None and cur.revision >= revision:
                    return cur.engine
                await self._changed.wait()
        assert scope.cancelled_caught
        raise RequestRejected(
            ErrorCode.ADAPTER_NOT_LOADED,
            f"adapter {name!r} is still loading on {self._ctx.instance} after {self.settings.load_wait:.0f}s",
            field="$.adapter",
        )
