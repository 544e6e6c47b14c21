"""Where a decode worker prefills a prompt: a pure decision, table-tested.

Handing a prompt to a prefill worker pays a job round trip and the blocks' trip through NATS to
keep a long prefill from stalling the token streams already running here. For a short prompt, for
one mostly in this engine's prefix cache already (little is left to compute), or when nobody could
take the job soon, that price buys nothing, so the prompt is computed here.
"""

from __future__ import annotations

import msgspec


class PrefillQueue(msgspec.Struct, kw_only=True, frozen=True):
    """The prefill consumer as the server last described it."""

    workers_waiting: int
    """Pull requests waiting: idle prefill workers."""
    queued: int
    """Prefill jobs no worker took yet."""
    running: int
    """Prefill jobs taken and not yet answered."""


class Decision(msgspec.Struct, kw_only=True, frozen=True):
    remote: bool
    reason: str
    """`remote`, or `local_<why>`: a metric label and the trace's words."""


def decide(
    prompt_tokens: int,
    *,
    full_block_tokens: int,
    threshold: int,
    queue: PrefillQueue | None,
    max_queue: int,
    cached_tokens: int = 0,
    min_cached: float = 0.0,
    continuation: bool = False,
    embeds: bool = False,
    adapter: bool = False,
) -> Decision:
    """`cached_tokens`: the prompt's leading tokens this engine's prefix cache holds (0 for a
    prompt without block ids); `min_cached`: the share of the prompt that makes it local (0: off)."""
    if continuation:
        return Decision(remote=False, reason="local_continuation")
    if embeds:
        return Decision(remote=False, reason="local_embeds")
    if adapter:
        return Decision(remote=False, reason="local_adapter")
    if prompt_tokens < threshold or full_block_tokens == 0:
        return Decision(remote=False, reason="local_short")
    if min_cached > 0 and cached_tokens >= min_cached * prompt_tokens:
        return Decision(remote=False, reason="local_cached")
    if queue is None or (queue.workers_waiting == 0 and queue.running == 0):
        return Decision(remote=False, reason="local_no_prefill_worker")
    if queue.queued >= max_queue:
        return Decision(remote=False, reason="local_queue_full")
    return Decision(remote=True, reason="remote")
