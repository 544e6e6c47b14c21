"""Brings an adapter's files from its source into a local, content-addressed cache.

Every source ends as `<cache>/<sha256>/`: a private copy that was hashed after copying. The
engine only ever gets such a copy, so a file changed, moved or deleted at the source after the
load can neither reach the engine unnoticed nor pull a path out from under it (a vLLM engine
dies when a request's adapter path is gone). A copy is removed only when the cache outgrows its
limit and no worker on this host holds it (cache.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import anyio
import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from ...adapterfiles import (
    ADAPTER_FILES,
    AdapterFileError,
    check_present,
    combined_sha256,
    digests,
    max_bytes,
)
from ...schemas import AdapterManifest, AdapterSpec, ErrorCode
from ...subjects import codec
from ...subjects.names import Names

log = logging.getLogger(__name__)

_manifest = codec.Decoder(AdapterManifest)


def inside(path: Path, roots: list[Path]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, str(root)]) == str(root) for root in roots)


class AdapterFiles:
    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        cache_dir: Path,
        allowed_dirs: list[Path],
        *,
        allow_hub: bool = False,
    ) -> None:
        self.js = js
        self.names = names
        self.cache_dir = Path(cache_dir)
        self.allowed = [Path(os.path.realpath(d)) for d in allowed_dirs]
        self.allow_hub = allow_hub

    async def fetch(self, spec: AdapterSpec) -> tuple[Path, str]:
        """(local verified copy, content hash), or AdapterFileError."""
        if spec.source == "object":
            return await self._from_store(spec)
        if spec.source == "hub":
            if not self.allow_hub:
                raise AdapterFileError(
                    "hub sources are off on this worker (start it with --lora-allow-hub)",
                    code=ErrorCode.ADAPTER_NOT_ALLOWED,
                )
            directory = await anyio.to_thread.run_sync(self._download_hub, spec.ref)
            return await anyio.to_thread.run_sync(self._copy_in, directory, spec.sha256, None)
        return await anyio.to_thread.run_sync(
            self._copy_in, self._checked_path(spec.ref), spec.sha256, self.allowed
        )

    def _checked_path(self, ref: str) -> Path:
        if not self.allowed:
            raise AdapterFileError(
                "path sources are off on this worker (no --lora-dir allows any directory)",
                code=ErrorCode.ADAPTER_NOT_ALLOWED,
            )
        path = Path(ref)
        if not path.is_absolute():
            raise AdapterFileError(
                f"adapter path {ref!r} must be absolute", code=ErrorCode.ADAPTER_NOT_ALLOWED
            )
        try:
            allowed = inside(path, self.allowed)
        except ValueError as exc:  # a NUL byte; AdapterSpec refuses control characters already
            raise AdapterFileError(
                f"adapter path {ref!r} is not a usable path ({exc})", code=ErrorCode.ADAPTER_NOT_ALLOWED
            ) from None
        if not allowed:
            raise AdapterFileError(
                f"adapter path {ref!r} is outside this worker's --lora-dir directories",
                code=ErrorCode.ADAPTER_NOT_ALLOWED,
            )
        if not path.is_dir():
            raise AdapterFileError(f"no adapter directory at {ref!r}", code=ErrorCode.ADAPTER_NOT_FOUND)
        return path

    def _copy_in(self, source: Path, expected: str | None, roots: list[Path] | None) -> tuple[Path, str]:
        check_present(source)
        tmp = self._tmp()
        try:
            for name in ADAPTER_FILES:
                src = source / name
                if roots is not None and not inside(src, roots):
                    raise AdapterFileError(
                        f"{name} links outside this worker's --lora-dir directories",
                        code=ErrorCode.ADAPTER_NOT_ALLOWED,
                    )
                if src.stat().st_size > max_bytes(name):
                    raise AdapterFileError(
                        f"{name} is larger than {max_bytes(name)} bytes", code=ErrorCode.ADAPTER_INVALID
                    )
                shutil.copyfile(src, tmp / name)
            return self._settle(tmp, expected)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _settle(self, tmp: Path, expected: str | None) -> tuple[Path, str]:
        """Hash the private copy and move it to its content address."""
        sha = combined_sha256(digests(tmp))
        if expected is not None and sha != expected:
            raise AdapterFileError(
                f"the adapter's files hash to {sha[:12]}, not the expected {expected[:12]}",
                code=ErrorCode.ADAPTER_INVALID,
            )
        final = self.cache_dir / sha
        if not final.is_dir():
            try:
                tmp.rename(final)
            except OSError:
                if not final.is_dir():  # another worker on this host may have settled it first
                    raise
        return final, sha

    def _tmp(self) -> Path:
        tmp = self.cache_dir / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        return tmp

    async def _from_store(self, spec: AdapterSpec) -> tuple[Path, str]:
        try:
            store = await self.js.object_store(self.names.adapters_store)
            sha = spec.sha256
            if sha is None:
                found = await store.get(self.names.adapter_manifest(spec.ref))
                # nats-py types ObjectResult.data Optional; a found object has it
                sha = _manifest.decode(found.data).sha256  # type: ignore[arg-type]
        except msgspec.DecodeError as exc:
            raise AdapterFileError(
                f"adapter {spec.ref!r}: its manifest in the adapters object store cannot be read "
                f"({exc}); push it again (jetllm lora push)",
                code=ErrorCode.ADAPTER_INVALID,
            ) from None
        except (
            nats.js.errors.NotFoundError,
            nats.js.errors.ObjectNotFoundError,
            nats.js.errors.BucketNotFoundError,
        ):
            raise AdapterFileError(
                f"no adapter {spec.ref!r} in the adapters object store (jetllm lora push)",
                code=ErrorCode.ADAPTER_NOT_FOUND,
            ) from None
        if (self.cache_dir / sha).is_dir():
            return self.cache_dir / sha, sha
        tmp = self._tmp()
        try:
            for name in ADAPTER_FILES:
                obj = self.names.adapter_file(sha, name)
                try:
                    info = await store.get_info(obj)
                    if (info.size or 0) > max_bytes(name):
                        raise AdapterFileError(
                            f"{name} is larger than {max_bytes(name)} bytes", code=ErrorCode.ADAPTER_INVALID
                        )
                    with open(tmp / name, "wb") as f:
                        await store.get(obj, writeinto=f)
                except (
                    nats.js.errors.NotFoundError,
                    nats.js.errors.ObjectNotFoundError,
                    nats.js.errors.ObjectDeletedError,
                ):
                    raise AdapterFileError(
                        f"adapter {spec.ref!r}: object {obj!r} is missing from the store",
                        code=ErrorCode.ADAPTER_NOT_FOUND,
                    ) from None
            return await anyio.to_thread.run_sync(self._settle, tmp, sha)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _download_hub(self, repo: str) -> Path:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id=repo, allow_patterns=list(ADAPTER_FILES)))
        except Exception as exc:  # offline, unknown repository, gated: all mean "not here"
            raise AdapterFileError(
                f"hub adapter {repo!r} unavailable: {type(exc).__name__}: {exc}",
                code=ErrorCode.ADAPTER_NOT_FOUND,
            ) from None
