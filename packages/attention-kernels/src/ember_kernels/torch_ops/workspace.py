"""Reusable scratch buffers for the CPU paths.

Allocating a fresh multi-megabyte tensor every step costs the kernel's page faults on each call
(large allocations go back to the OS when freed); gathering into a kept buffer is several times
faster. One buffer per name, dtype and device, per thread, grown on demand and never shrunk.
"""

from __future__ import annotations

import threading

import torch


class Workspace(threading.local):
    """Per-thread named scratch buffers, grown to the largest size requested so far."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements; its contents are whatever the last user left."""
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]

    def clear(self) -> None:
        """Release every buffer of the calling thread."""
        self._buffers.clear()


WORKSPACE = Workspace()
