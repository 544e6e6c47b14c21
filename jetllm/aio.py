"""Running jetllm's async entry points: anyio on asyncio, with uvloop when it is installed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    try:
        import uvloop  # noqa: F401

        opts = {"use_uvloop": True}
    except ImportError:
        opts = {}
    return anyio.run(fn, *args, backend="asyncio", backend_options=opts)
