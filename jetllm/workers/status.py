"""A worker's answer to a status request, the scatter-gather of `subjects/fleet.py` (tests and the
demo wait for workers and read their counters with it).

Built only when asked, unlike the registry record rewritten every beat, so it can carry the whole
picture: the requests running here, the engine's load, every counter.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from .. import __version__
from ..schemas import WorkerStatus

if TYPE_CHECKING:
    from .runtime import Worker


def worker_status(w: Worker) -> WorkerStatus:
    load = w.engine.load()
    return WorkerStatus(
        instance=w.instance,
        role=w.role.role,
        model=w.model,
        state=w.state,
        slots=w.slots,
        in_flight=w._busy,
        request_ids=sorted(w._running),
        engine_unfinished=load.unfinished,
        started_at=w.started_at,
        version=__version__,
        host=socket.gethostname(),
        pid=os.getpid(),
        extra={
            "engine": w.engine.facts.engine,
            "engine_running": str(load.running),
            "engine_waiting": str(load.waiting),
            "max_model_len": str(w.engine.facts.max_model_len),
            **{k: str(v) for k, v in w.counters.items()},
            **{f"kv_{k}": str(v) for k, v in w.kv_events.counters.items() if w.kv_events.running},
        },
    )
