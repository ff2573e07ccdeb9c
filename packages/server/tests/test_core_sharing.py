"""The served engine's small steps take every core only while other processes leave them."""

import subprocess
import sys
import time

import pytest

from ember_server import core_sharing
from ember_server.core_sharing import CoreSharing, OtherProcessesCPU
from ember_worker.step_threads import StepThreads


class ScriptedLoad:
    """Other processes' CPU as a script of samples (None: /proc unreadable)."""

    def __init__(self, samples):
        self.samples = list(samples)

    def sample(self):
        return self.samples.pop(0)


@pytest.mark.parametrize("cores", [2, 4])
def test_small_steps_leave_a_core_while_others_use_one_and_take_it_back_when_they_stop(
    monkeypatch, cores
):
    monkeypatch.setattr(core_sharing, "CHECK_INTERVAL_S", 0.0)
    threads = StepThreads(cores, cores, large_min_tokens=32)
    sharing = CoreSharing(threads, ScriptedLoad([0.1, 0.8, 0.4, None, 0.3, 0.2, 1.5]))
    seen = []
    for _ in range(7):
        sharing.poll()
        seen.append((threads.large, threads.small))
    busy, quiet = (cores, cores - 1), (cores, cores)
    # Between the two thresholds, and when nothing could be read, the count stays as it was.
    assert seen == [quiet, busy, busy, busy, busy, quiet, busy]


def test_one_core_is_never_left_with_no_thread(monkeypatch):
    monkeypatch.setattr(core_sharing, "CHECK_INTERVAL_S", 0.0)
    threads = StepThreads(1)
    CoreSharing(threads, ScriptedLoad([3.0])).poll()
    assert threads.small == 1


def test_checks_at_most_once_an_interval():
    threads = StepThreads(2, 2)
    load = ScriptedLoad([0.9])
    sharing = CoreSharing(threads, load)
    for _ in range(100):
        sharing.poll()  # within the first interval: nothing sampled
    assert load.samples == [0.9] and threads.small == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_busy_process_counts_unless_it_is_one_of_ours():
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", burn])
    everyone = OtherProcessesCPU(())
    all_but_child = OtherProcessesCPU((child.pid,))
    time.sleep(0.5)  # the child burns meanwhile
    with_child, without_child = everyone.sample(), all_but_child.sample()
    child.wait()
    # The child's share of the window is what separates the two (it runs on its own core).
    assert with_child - without_child > 0.2
    assert OtherProcessesCPU((child.pid,)).sample() is None  # a pid that is gone: unreadable
