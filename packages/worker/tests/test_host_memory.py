"""``retain_freed_host_memory``: a step's large activations reuse freed heap memory instead of
faulting in fresh pages each time."""

from __future__ import annotations

import pathlib
import resource
import subprocess
import sys

import pytest

# Run in a child process: the thresholds are process-wide, and the child measures its own page
# faults before and after raising them.
CHILD = """
import resource, torch
from ember_worker.host_memory import retain_freed_host_memory

def faults_of_reallocation():
    # A 64 MB block (above glibc's largest dynamic mmap threshold), freed and asked for again.
    block = torch.ones(64 << 20, dtype=torch.uint8)
    del block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(64 << 20, dtype=torch.uint8)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = [faults_of_reallocation() for _ in range(3)]
assert retain_freed_host_memory() and retain_freed_host_memory()
retained = [faults_of_reallocation() for _ in range(10)]
print(min(plain), max(retained[-3:]))
"""


def _transparent_huge_pages_always() -> bool:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="huge pages fault rarely anyway")
def test_freed_blocks_are_reused_without_page_faults():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    plain, retained = int(out[0]), int(out[1])
    pages = (64 << 20) // resource.getpagesize()
    assert plain >= pages // 2  # glibc maps a block this large afresh at each allocation
    assert retained < pages // 64  # the heap's freed block is reused, its pages already there
