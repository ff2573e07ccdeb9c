"""Keep freed host memory in the process for the next model step (glibc's ``mallopt``).

A CPU step allocates its activations afresh, and at a decoder's sizes many are tens of MB (a
2,048-token prefill's gate/up output is 40 MB in bfloat16; a batch's logits over a 152k
vocabulary are 10-20 MB). glibc serves a block above its mmap threshold (dynamic, at most 32 MB)
with a fresh ``mmap`` and returns it at ``free``, and gives the top of its heap back to the system
above its trim threshold: the next step then touches new pages, and the kernel zeroes each on its
first fault. That costs a CPU step several percent of its time (the worker README has the
figures). vLLM's CPU backend preloads tcmalloc for the same reason; raising both thresholds does
it in place for the per-step sizes. The worker raises them once its weights are loaded, so that
loading's temporary copies still go back to the system; what stays in the heap after that is the
KV cache and the steps' own working set, which the next step reuses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# Blocks below this many bytes come from the heap and go back to it, and this much free memory
# may stay at the heap's top: above a prefill's largest activation at usual step sizes (8,192
# float32 tokens through a 9,728-wide gate/up projection is 320 MB). ``mallopt`` takes an int.
RETAINED_BLOCK_BYTES = 1 << 29

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_applied = False


def retain_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to ``RETAINED_BLOCK_BYTES`` for this process (once;
    later calls do nothing); whether they are raised (False where the C library is not glibc)."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, RETAINED_BLOCK_BYTES))
    applied = bool(mallopt(_M_TRIM_THRESHOLD, RETAINED_BLOCK_BYTES)) and applied
    _applied = applied
    return applied
