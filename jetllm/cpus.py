"""Cores for engines that share a host.

vLLM on CPU binds an engine's model runner to cores it picks without looking at other engines:
every engine on a host takes the same ones, and two of them spin against each other on one core
while the rest idle (docs/decisions.md, "Engines that share a host get cores of their own").
Whoever starts several engines on one host gives each its share through vLLM's own variable.
"""

from __future__ import annotations

import os

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def engine_cores(index: int, engines: int) -> dict[str, str]:
    """The environment for engine `index` of `engines` started on this host: a disjoint share of
    the cores this process may use. Empty when the operator chose a binding, or for a lone engine."""
    if BIND in os.environ or engines < 2:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // engines)
    start = (index % max(1, len(cpus) // share)) * share
    return {BIND: ",".join(map(str, cpus[start : start + share]))}
