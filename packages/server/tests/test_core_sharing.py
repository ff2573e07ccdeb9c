"""The served engine's small steps take every core only while other processes leave them."""

import subprocess
import sys
import time

import pytest

from ember_server.engine import core_sharing
from ember_server.engine.core_sharing import CoreSharing, OtherProcessesCPU
from ember_worker.step_threads import StepThreads


class ScriptedLoad:
    """Other processes' CPU as a script of (cores, seconds) samples (None: /proc unreadable)."""

    def __init__(self, samples):
        self.samples = list(samples)

    def sample(self):
        return self.samples.pop(0)


def _run(sharing, threads, steps):
    seen = []
    for _ in range(steps):
        sharing.poll()
        seen.append(threads.small)
    return seen


@pytest.mark.parametrize("cores", [2, 4])
def test_small_steps_leave_a_core_while_others_use_one_and_take_it_back_when_they_stop(
    monkeypatch, cores
):
    monkeypatch.setattr(core_sharing, "CHECK_INTERVAL_S", 0.0)
    threads = StepThreads(cores, cores, large_min_tokens=32)
    # Samples over long windows: the average is the last sample.
    script = [(x, 1e3) if x is not None else None for x in (0.1, 0.8, 0.4, None, 0.3, 0.2, 1.5)]
    seen = _run(CoreSharing(threads, ScriptedLoad(script)), threads, len(script))
    busy, quiet = cores - 1, cores
    # Between the two thresholds, and when nothing could be read, the count stays as it was.
    assert seen == [quiet, busy, busy, busy, busy, quiet, busy]
    assert threads.large == cores


def test_a_burst_does_not_take_a_core_a_sustained_load_does(monkeypatch):
    monkeypatch.setattr(core_sharing, "CHECK_INTERVAL_S", 0.0)
    threads = StepThreads(2, 2)
    # A second of a whole core (a client starting), then quiet; then a build on both cores.
    script = [(1.0, 1.0)] + [(0.05, 1.0)] * 3 + [(2.0, 1.0)] * 3 + [(0.0, 1.0)] * 8
    seen = _run(CoreSharing(threads, ScriptedLoad(script)), threads, len(script))
    assert seen[:4] == [2, 2, 2, 2]
    assert seen[4:7] == [1, 1, 1]  # within a second of the build's start
    assert seen[-1] == 2 and 1 in seen[7:]  # given back once the average has decayed


def test_one_core_is_never_left_with_no_thread(monkeypatch):
    monkeypatch.setattr(core_sharing, "CHECK_INTERVAL_S", 0.0)
    threads = StepThreads(1)
    CoreSharing(threads, ScriptedLoad([(3.0, 1e3)])).poll()
    assert threads.small == 1


def test_checks_at_most_once_an_interval():
    threads = StepThreads(2, 2)
    load = ScriptedLoad([(0.9, 1e3)])
    sharing = CoreSharing(threads, load)
    for _ in range(100):
        sharing.poll()  # within the first interval: nothing sampled
    assert load.samples == [(0.9, 1e3)] and threads.small == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_busy_process_counts_unless_it_is_one_of_ours():
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", burn])
    everyone = OtherProcessesCPU(())
    all_but_child = OtherProcessesCPU((child.pid,))
    time.sleep(0.5)  # the child burns meanwhile
    (with_child, _), (without_child, _) = everyone.sample(), all_but_child.sample()
    child.wait()
    # The child's share of the window is what separates the two (it runs on its own core).
    assert with_child - without_child > 0.2
    assert OtherProcessesCPU((child.pid,)).sample() is None  # a pid that is gone: unreadable


def test_steal_counts_as_taken_and_idle_time_does_not():
    """/proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice."""
    base = [100, 0, 50, 1000, 10, 1, 2, 0, 0, 0]
    stolen = list(base)
    stolen[7] += 300
    idle = list(base)
    idle[3] += 300
    idle[4] += 50
    guest = list(base)
    guest[8] += 30  # already inside user
    assert core_sharing.taken_ticks(stolen) - core_sharing.taken_ticks(base) == 300
    assert core_sharing.taken_ticks(idle) == core_sharing.taken_ticks(guest)
    assert core_sharing.taken_ticks(idle) == core_sharing.taken_ticks(base)
