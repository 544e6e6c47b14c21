"""What a job naming an adapter gets on this worker: the engine adapter it runs with, or why not.

A job waits (up to `load_wait`) only while waiting can help, that is while the adapter's newest
desired revision is still being loaded here. A revision that failed to load, or an adapter the
model does not have, fails the job at once, so its client hears why now and not after the wait.
An adapter whose newest desired state this worker cannot read goes on serving the copy it has.
"""

from __future__ import annotations

from ...errors import RequestRejected
from ...schemas import AdapterSpec, ErrorCode
from ..engine import EngineAdapter


def runs_with(
    name: str,
    desired: tuple[int, AdapterSpec | None],
    loaded: tuple[int, EngineAdapter] | None,
    failed: tuple[int, ErrorCode, str] | None,
    *,
    kept: bool,
    model: str,
    instance: str,
) -> EngineAdapter | None:
    """`desired`, `loaded` and `failed` each lead with their revision; None: wait for a change."""
    revision, spec = desired
    if kept and loaded is not None:
        return loaded[1]
    if failed is not None and failed[0] == revision:
        raise RequestRejected(
            ErrorCode.ADAPTER_NOT_LOADED,
            f"adapter {name!r} failed to load on {instance}: {failed[1].value}: {failed[2]}",
            field="$.adapter",
        )
    if spec is None:
        raise RequestRejected(
            ErrorCode.UNKNOWN_ADAPTER,
            f"model {model!r} has no adapter {name!r} (jetllm lora list)",
            field="$.adapter",
        )
    if loaded is not None and loaded[0] >= revision:
        return loaded[1]
    return None


def lora_disabled(name: str, model: str) -> RequestRejected:
    return RequestRejected(
        ErrorCode.LORA_DISABLED,
        f"adapter {name!r}: the workers of {model!r} run without LoRA",
        field="$.adapter",
    )


def still_loading(name: str, instance: str, waited: float) -> RequestRejected:
    return RequestRejected(
        ErrorCode.ADAPTER_NOT_LOADED,
        f"adapter {name!r} is still loading on {instance} after {waited:.0f}s",
        field="$.adapter",
    )
