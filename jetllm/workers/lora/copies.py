"""An adapter's cached copy as the manager hands it to the engine: fetched, held, validated.

The engine may only read a copy this worker holds, since a pruner on this host removes any copy
nobody holds (cache.py), and that passed the checks against the base model (validate.py). A copy
pruned between fetching and holding it is fetched again. Whatever goes wrong becomes a
ControlError naming the adapter, with the code the verb answers and `lora-list` records.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio

from ...adapterfiles import AdapterFileError
from ...schemas import AdapterSpec, ErrorCode
from ..control import ControlError
from ..engine import LoraFacts
from .cache import Held, hold, prune
from .files import AdapterFiles
from .validate import validate

log = logging.getLogger(__name__)


def _refused(name: str, exc: AdapterFileError) -> ControlError:
    return ControlError(f"adapter {name!r}: {exc.message}", code=exc.code)


async def fetch(files: AdapterFiles, name: str, spec: AdapterSpec) -> tuple[Path, str, Held]:
    """The verified copy, held; fetched again if a pruner on this host took it meanwhile."""
    for _ in range(3):
        try:
            path, sha = await files.fetch(spec)
        except AdapterFileError as exc:
            raise _refused(name, exc) from None
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


async def check(name: str, path: Path, facts: LoraFacts) -> None:
    try:
        await anyio.to_thread.run_sync(validate, path, facts)
    except AdapterFileError as exc:
        raise _refused(name, exc) from None


async def prune_cache(cache_dir: Path, max_bytes: int) -> None:
    if max_bytes > 0:
        try:
            removed = await anyio.to_thread.run_sync(prune, cache_dir, max_bytes)
        except OSError as exc:  # a full or read-only disk must not take the worker down
            log.warning("adapter cache not pruned: %s", exc)
            return
        if removed:
            log.info(
                "adapter cache over %d bytes: removed %d unused copies (%s)",
                max_bytes,
                len(removed),
                ", ".join(r[:12] for r in removed),
            )
