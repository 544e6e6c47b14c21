"""`jetllm worker --headless`: engine ranks for a data-parallel leader on another host.

A headless process runs vLLM engine cores only. The leader's worker schedules requests onto them
through vLLM's own data-parallel transport, so this process has nothing to do with NATS: it pulls
no jobs, answers no control subjects, and shows up in the registry only through the leader's
record (its ranks are in the leader's `dp_ranks`). SIGTERM or SIGINT stops its engines and exits 0.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
from typing import Any

from .engine.options import EngineOptions

log = logging.getLogger(__name__)


def run_headless(opts: EngineOptions) -> int:
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    from .. import reaper
    from .engine.args import engine_args

    if (
        opts.data_parallel_size < 2
        or not opts.data_parallel_size_local
        or opts.data_parallel_start_rank is None
    ):
        raise ValueError(
            "--headless needs --data-parallel-size > 1, --data-parallel-size-local and "
            "--data-parallel-start-rank (and the leader's --data-parallel-address/-rpc-port)"
        )
    args = engine_args(opts)
    config = args.create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
    parallel = config.parallel_config
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # no event loop here: threads are the dump
    leader = get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)
    log.info(
        "headless: ranks %d..%d of %d for the leader at %s",
        parallel.data_parallel_rank,
        parallel.data_parallel_rank + parallel.data_parallel_size_local - 1,
        parallel.data_parallel_size,
        leader,
    )
    before = reaper.descendants()
    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local,
        start_index=parallel.data_parallel_rank,
        local_start_index=0,
        vllm_config=config,
        local_client=False,
        handshake_address=leader,
        executor_class=Executor.get_class(config),
        log_stats=not args.disable_log_stats,
    )
    reaper.watch(reaper.descendants() - before)
    try:
        manager.monitor_engine_liveness()
    except SystemExit:
        pass
    finally:
        manager.shutdown(timeout=config.shutdown_timeout if stopping else None)
        log.info("headless ranks stopped")
    return 0 if stopping else 1
