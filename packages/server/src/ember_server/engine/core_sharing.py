"""Whether the served engine may take every core for its small steps: it may while the machine's
other processes leave the cores to the engine and its front end.

Two threads make a served step faster on a quiet machine, small steps included (see
``engine_factory.default_step_threads``), but each of a step's parallel regions waits for its
slowest thread: once another process takes a core, the thread on it stalls every region of the
step, and small steps, made of many short regions, lose several times over (the server README
has the figures). A virtual machine's host taking its CPUs for other VMs (steal) does the same,
so steal counts as taken cores.
Large steps keep every core either way.
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember_worker.step_threads import StepThreads

# Cores' worth of CPU the other processes must use, on average over the last few seconds
# (AVERAGE_S), before small steps leave them a core, and must fall under before small steps take
# every core again. A benchmark client on the same machine used 0.02-0.2 of a core, and its
# start-up a second's burst; a build or a test run uses one or more for minutes.
BUSY_CORES = 0.5
QUIET_CORES = 0.25
AVERAGE_S = 3.0
CHECK_INTERVAL_S = 1.0


class OtherProcessesCPU:
    """Cores' worth of CPU used by every process except ``pids`` between two calls, and taken
    by the hypervisor (steal), read from Linux's /proc (where there is none, every sample is
    None and nothing changes)."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        self.pids = pids
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    def sample(self) -> tuple[float, float] | None:
        """(cores used by the other processes since the last call, seconds since it); None if
        unreadable."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        elapsed = now[0] - last[0]
        if elapsed <= 0:
            return None
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / self._ticks_per_s / elapsed), elapsed

    def _read(self) -> tuple[float, int, int] | None:
        """(monotonic seconds, busy ticks of the whole machine, CPU ticks of ``pids``)."""
        try:
            with open("/proc/stat") as stat:
                ticks = [int(x) for x in stat.readline().split()[1:]]
            ours = 0
            for pid in self.pids:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])  # utime + stime, all its threads
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), taken_ticks(ticks), ours


def taken_ticks(ticks: list[int]) -> int:
    """Ticks of /proc/stat's ``cpu`` line in which the CPUs were not free for the engine: user,
    nice, system, irq, softirq, and steal (the hypervisor ran another VM on our virtual CPUs:
    for a step whose parallel regions wait on their slowest thread, a core taken that way is
    as gone as one another process takes). Not idle or iowait, nor guest (counted in user)."""
    return ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]


class CoreSharing:
    """Sets ``step_threads.small`` to every core (``step_threads.large``) while other processes
    use under ``QUIET_CORES`` of a core, to one fewer once they use over ``BUSY_CORES`` (both
    averaged over about ``AVERAGE_S`` seconds); checks at most every ``CHECK_INTERVAL_S``
    seconds, from the engine's loop (``poll``)."""

    def __init__(self, step_threads: StepThreads, others: OtherProcessesCPU) -> None:
        self.step_threads = step_threads
        self.others = others
        self.average = 0.0  # cores, an exponential moving average
        self._next_check = time.monotonic() + CHECK_INTERVAL_S

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        sample = self.others.sample()
        if sample is None:
            return
        used, elapsed = sample
        self.average += (used - self.average) * (1.0 - math.exp(-elapsed / AVERAGE_S))
        threads = self.step_threads
        if self.average > BUSY_CORES:
            threads.small = max(1, threads.large - 1)
        elif self.average < QUIET_CORES:
            threads.small = threads.large
