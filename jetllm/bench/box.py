"""How fast, and how shared, the box was while a benchmark ran: one line under its figures.

On a small shared machine the same command's absolute figures move by several times between days
(the direct engine made 5,298 tok/s one afternoon and 1,934 the next night), while the ratios the
targets are about move far less. The line says why two runs differ: a fixed pure-Python loop timed
before and after (the speed one core gives the plane's code), the share of CPU time the host took
for others (Linux's `steal`), and the load before the run. It does not correct anything.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

REFERENCE_LOOP = 2_000_000
"""Additions in the reference loop: ~0.1 s on a quick core, long enough for a steady figure."""


def reference_loop_ms() -> float:
    """The reference loop's time, best of three (what the box gives one core now)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for i in range(REFERENCE_LOOP):
            total += i
        best = min(best, time.perf_counter() - started)
    return best * 1000


def cpu_times(stat: str) -> tuple[int, ...] | None:
    """The whole box's CPU counters from /proc/stat's text (user, nice, system, idle, iowait, irq,
    softirq, steal); None when there is no such line."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu" and len(fields) >= 9:
            try:
                return tuple(int(f) for f in fields[1:9])
            except ValueError:
                return None
    return None


def stolen_share(before: tuple[int, ...], after: tuple[int, ...]) -> float | None:
    """The share of CPU time between the two readings that the host gave someone else."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent)
    return spent[7] / total if total > 0 else None


def process_ticks(stat: str) -> int | None:
    """User plus system clock ticks of one process, from /proc/<pid>/stat's text (its own threads,
    not its children's); None when the text is not such a line. The command name in parentheses
    may hold spaces and parentheses itself, so fields are counted after its last ')'."""
    _, paren, rest = stat.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < 13:
        return None
    try:
        return int(fields[11]) + int(fields[12])
    except ValueError:
        return None


def cpu_seconds(pids: list[int]) -> float:
    """CPU time the processes have used so far, in seconds; a process already gone counts 0."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ticks += process_ticks(f.read()) or 0
        except OSError:
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def _read_stat() -> tuple[int, ...] | None:
    try:
        with open("/proc/stat") as f:
            return cpu_times(f.read())
    except OSError:
        return None


@dataclass
class BoxWatch:
    loop_ms: float
    stat: tuple[int, ...] | None
    load: float | None

    @classmethod
    def start(cls) -> BoxWatch:
        try:
            load: float | None = os.getloadavg()[0]
        except OSError:
            load = None
        return cls(loop_ms=reference_loop_ms(), stat=_read_stat(), load=load)

    def line(self) -> str:
        """Call as the run ends: times the loop again and reads the counters since `start`."""
        after_stat = _read_stat()
        stolen = stolen_share(self.stat, after_stat) if self.stat and after_stat else None
        return describe(self.loop_ms, reference_loop_ms(), stolen, self.load)


def describe(before_ms: float, after_ms: float, stolen: float | None, load: float | None) -> str:
    parts = [
        f"Box: a reference loop ({REFERENCE_LOOP:,} Python additions, `jetllm.bench.box`) took "
        f"{before_ms:.0f} ms before the run and {after_ms:.0f} ms after"
    ]
    if stolen is not None:
        parts.append(f"the host took {stolen * 100:.1f} % of the CPU time during the run for others (steal)")
    if load is not None:
        parts.append(f"load average {load:.2f} before it")
    return "; ".join(parts) + "."
