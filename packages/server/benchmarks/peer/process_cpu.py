"""CPU accounting of the peer benchmark's runs, from Linux /proc: the machine's steal time and
the CPU seconds of a server process and of the processes it started."""

from __future__ import annotations

import os


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) ticks of the whole machine so far (Linux /proc/stat): steal is time the
    hypervisor gave this VM's CPUs to others, which slows every figure of a run."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return ticks[7], sum(ticks)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process so far, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    found, parents = [], {pid}
    while parents:
        children = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if parent in parents:
                children.add(int(name))
        found += children
        parents = children
    return found


class ProcessCPU:
    """CPU seconds of a server's own process and of all the processes it started."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def sample(self) -> tuple[float, float]:
        started = 0.0
        for pid in _descendants(self.server_pid):
            try:
                started += _cpu_seconds(pid)
            except OSError:  # a helper process that ended meanwhile
                continue
        return _cpu_seconds(self.server_pid), started
