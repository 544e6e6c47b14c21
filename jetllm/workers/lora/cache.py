"""Keeping the adapter cache within its size; a copy some worker on this host uses is never removed.

vLLM reads an adapter from its path again whenever it evicted it from its own LoRA cache, and an
engine whose adapter path is gone dies. So every worker holds a shared `flock` on `<copy>/.in-use`
for as long as its engine may read the copy; the kernel drops it when the worker dies, however
it dies. Pruning takes an exclusive lock without waiting, so it removes only copies nobody
holds, least recently used first, and renames a copy aside before deleting it, so no worker can
lock a half-deleted directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from pathlib import Path

LOCK = ".in-use"


class Held:
    """A shared lock on one copy; release() when the engine no longer has the adapter."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


def hold(copy: Path) -> Held | None:
    """A shared lock on `copy`; None when it was pruned meanwhile (fetch it again)."""
    try:
        fd = os.open(copy / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a pruner renames the copy aside
    try:
        current = os.stat(copy / LOCK).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        current = False
    if not current:  # the pruner moved it away between our open and our lock
        os.close(fd)
        return None
    os.utime(fd)  # the last use, which orders pruning
    return Held(fd)


def _copies(cache: Path) -> list[tuple[float, int, Path]]:
    found = []
    for copy in cache.iterdir():
        if not copy.is_dir() or copy.name.startswith("."):
            continue  # .tmp-* are copies being made, .trash-* being deleted
        try:
            size = sum(f.stat().st_size for f in copy.iterdir() if f.is_file())
            lock = copy / LOCK
            used = (lock if lock.exists() else copy).stat().st_mtime
        except FileNotFoundError:
            continue
        found.append((used, size, copy))
    return sorted(found)


def size(cache: Path) -> int:
    return sum(size for _, size, _ in _copies(cache)) if cache.is_dir() else 0


def prune(cache: Path, max_bytes: int) -> list[str]:
    """Remove copies nobody holds, least recently used first, until the cache fits in `max_bytes`."""
    if not cache.is_dir():
        return []
    copies = _copies(cache)
    total = sum(size for _, size, _ in copies)
    removed = []
    for _, nbytes, copy in copies:
        if total <= max_bytes:
            break
        try:
            fd = os.open(copy / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
        trash = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            trash = cache / f".trash-{uuid.uuid4().hex}"
            os.rename(copy, trash)
        except (BlockingIOError, FileNotFoundError):
            continue  # in use by a worker on this host, or another pruner took it
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        total -= nbytes
        removed.append(copy.name)
    return removed
