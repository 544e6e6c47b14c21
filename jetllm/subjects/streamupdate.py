"""What an existing stream needs changed for one side that starts on it: a pure decision.

Producers, commands and workers of every pool all ensure the namespace's streams when they start.
Were each to write its whole configuration, the settings would be whoever connected last's, and
a producer's defaults would undo the `--max-age` an operator gave the workers. So a side changes
only what it owns or what its code cannot work without:

- the settings it was given (`owned`: a `QueuePolicy` field that is not None, a prefill worker's
  block store limits); a default is nobody's choice and changes nothing;
- limits its records need at least (`raised`: the request log must outlive a queued job), which
  are raised, never lowered;
- what this version of jetllm reads and writes: subjects it publishes to are added (never
  removed, so an older side's subjects stay), direct gets are allowed, and so are rollups;
- replicas, when it names them (`rescale`; see setup.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from nats.js.api import StreamConfig


@dataclasses.dataclass(frozen=True)
class Wanted:
    """A stream as one side would create it, and which of its settings that side decides."""

    config: StreamConfig
    owned: Collection[str] = ()
    """StreamConfig fields set to `config`'s value on an existing stream."""
    raised: Collection[str] = ()
    """StreamConfig fields raised to at least `config`'s value (limits: larger is more, 0 is none)."""


def update_for(current: StreamConfig, wanted: Wanted, *, rescale: bool) -> StreamConfig | None:
    """`current` with the changes `wanted` calls for, None when it calls for none."""
    want = wanted.config
    changes: dict[str, Any] = {}
    subjects = list(current.subjects or [])
    subjects += [s for s in want.subjects or [] if s not in subjects]
    if subjects != list(current.subjects or []):
        changes["subjects"] = subjects
    if want.allow_direct and not current.allow_direct:
        changes["allow_direct"] = True
    if want.allow_rollup_hdrs and not current.allow_rollup_hdrs:
        changes["allow_rollup_hdrs"] = True
    if rescale and (want.num_replicas or 1) != (current.num_replicas or 1):
        changes["num_replicas"] = want.num_replicas
    for name in wanted.raised:
        value, now = getattr(want, name), getattr(current, name)
        if value is not None and now and value > now:  # 0 or None: no limit, nothing to raise
            changes[name] = value
    for name in wanted.owned:
        value = getattr(want, name)
        if value is not None and value != getattr(current, name):
            changes[name] = value
    return dataclasses.replace(current, **changes) if changes else None


def changed(current: StreamConfig, update: StreamConfig) -> list[str]:
    """The names of the settings `update` changes, for the log."""
    return [f.name for f in dataclasses.fields(update) if getattr(update, f.name) != getattr(current, f.name)]
