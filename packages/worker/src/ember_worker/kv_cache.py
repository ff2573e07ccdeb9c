"""KV cache tensors sized from a memory budget.

Every layer gets a key and a value tensor ``[num_blocks, block_size, num_kv_heads, head_size]``
(the ``ember_kernels`` paged layout). All of them are views into one allocation, so the block
count is decided once, from the budget, and reported to the scheduler.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ember_worker.model_loader import LoadedModel


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one model's KV cache per block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    # 2: a key and a value tensor per layer; 1: one tensor read as both (MLA's latent cache).
    tensors_per_layer: int = 2

    @classmethod
    def for_model(cls, loaded: LoadedModel, block_size: int) -> KVCacheSpec:
        """This rank's share: its pipeline stage's layers and its tensor-parallel KV heads."""
        layers = loaded.model.local_layers
        # A hybrid's Mamba layers keep no paged KV (ember_worker.mamba_state holds theirs).
        holders = [i for i in layers if hasattr(loaded.model.model.layers[i], "self_attn")]
        attention = loaded.model.model.layers[holders[0]].self_attn
        return cls(
            num_layers=len(holders),
            block_size=block_size,
            num_kv_heads=attention.attn.num_kv_heads,
            head_size=attention.attn.head_size,
            dtype=loaded.dtype,
            tensors_per_layer=1 if getattr(attention, "latent_cache", False) else 2,
        )

    @property
    def bytes_per_block(self) -> int:
        """Key and value bytes of one block across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.tensors_per_layer
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * element
        )

    def num_blocks_for(self, memory_bytes: int) -> int:
        if memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {memory_bytes}")
        num_blocks = memory_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {memory_bytes} bytes holds no KV block "
                f"(one block needs {self.bytes_per_block} bytes)"
            )
        return num_blocks


def kv_cache_budget(
    device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float
) -> int:
    """Bytes for the KV cache: ``kv_cache_memory`` when given (required on the CPU); on a GPU,
    otherwise, ``gpu_memory_utilization`` (in (0, 1], checked by ``WorkerConfig``) of the memory
    free once the model is loaded."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory)
    if device.type != "cuda":
        raise ValueError("kv_cache_memory (bytes) is required when the model runs on the CPU")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * gpu_memory_utilization)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key_cache, value_cache) pair per layer, zero-filled, from a single allocation; with
    one tensor per layer (MLA), the pair is that tensor twice."""
    shape = (
        spec.num_layers,
        spec.tensors_per_layer,
        num_blocks,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_size,
    )
    if device.type == "cpu":
        storage = _zeroed_cpu_tensor(shape, spec.dtype)
    else:
        storage = torch.zeros(shape, dtype=spec.dtype, device=device)
    return [(storage[i, 0], storage[i, -1]) for i in range(spec.num_layers)]


def copy_kv_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]
) -> None:
    """Copy whole blocks of every layer's keys and values, ``(source, target)`` block ids, in
    order (the KV cache manager lists a block as a source before it lists it as a target). One
    copy per block and layer: a step has a copy or two, and indexed copies cost 3x as much."""
    for source, target in copies:
        for key_cache, value_cache in kv_caches:
            key_cache[target].copy_(key_cache[source])
            value_cache[target].copy_(value_cache[source])


def _zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on an anonymous memory map, whose pages the OS maps, already zero, on
    first touch: ``torch.zeros`` writes every byte at start-up, while a block's first touch later
    costs a little of the step that first writes it. Page-aligned (the kernels' vector
    loads want 64 bytes).

    Without transparent huge pages: on a huge page the first touch maps and zeroes 2 MiB at once,
    which stalls the one prefill whose blocks cross into a new huge page far longer than small
    pages spread over every prompt cost (the worker README has the figures); decode runs as fast
    on either. numpy's ``zeros``, used
    before, asks for huge pages on any array of 4 MiB or more.
    """
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous, not shared memory
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
