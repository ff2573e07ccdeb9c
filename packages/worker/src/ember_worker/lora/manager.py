"""The adapters of one worker rank: a fixed number of weight slots on the device, a host cache
of loaded adapters (least recently used dropped first), and each step's row-to-slot mapping.

Adapters are loaded on first use from the ``LoRARequest`` that came with a request, so every
rank loads its own shard and a runtime-loaded adapter needs no message of its own. The
scheduler guarantees at most ``max_loras`` distinct adapters per step; a step's adapters take
slots, evicting the least recently used adapters of earlier steps.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ember_kernels.lora import LoRAMapping
from ember_scheduler.lora import LoRAConfig, LoRARequest
from ember_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from ember_worker.lora.adapter import LoRAAdapter, load_adapter, slice_sizes
from ember_worker.lora.layers import LoRALinearDelta, LoRAStepMapping
from ember_worker.models.config import DecoderConfig


class LoRAManager:
    """Attaches a ``LoRALinearDelta`` to every attention and MLP projection of ``model`` (this
    rank's layers) and keeps which adapter sits in which slot."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: DecoderConfig,
        lora_config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.lora_config = lora_config
        self.dtype = dtype
        self.device = device
        self.step = LoRAStepMapping()
        self.deltas: dict[tuple[int, str], LoRALinearDelta] = {}
        sizes = slice_sizes(config)
        for name, module in model.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            target = next((t for t in sizes if name.endswith(f".{t}")), None)
            if target is None or ".layers." not in name:
                continue
            layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
            delta = LoRALinearDelta(
                module,
                sizes[target],
                lora_config.max_loras,
                lora_config.max_lora_rank,
                self.step,
                dtype,
                device,
            )
            module.lora = delta
            self.deltas[(layer, target)] = delta
        self.requests: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.free_slots = list(range(lora_config.max_loras - 1, -1, -1))

    def add_request(self, request: LoRARequest) -> None:
        """Remember where an adapter lives (its weights are read when a step first needs it)."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            self.remove_adapter(request.lora_int_id)  # the id now names another folder
        self.requests[request.lora_int_id] = request

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Load (or find) an adapter in the host cache; ValueError for one that cannot run."""
        self.add_request(request)
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.config, self.lora_config.max_lora_rank, self.dtype)
            self.host[request.lora_int_id] = adapter
            while len(self.host) > self.lora_config.cpu_capacity:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return adapter

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy, its slot (freed) and its folder."""
        self.requests.pop(lora_int_id, None)
        self.host.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def prepare_step(self, row_lora_ids: np.ndarray, num_scheduled: np.ndarray) -> None:
        """Set the mapping of the step about to run: each scheduled token's slot, from its
        row's adapter id (0: none) and the row's scheduled-token count."""
        ids, inverse = np.unique(row_lora_ids, return_inverse=True)
        if (ids.size == 1 and ids[0] == 0) or not num_scheduled.any():
            self._set_mapping(None)
            return
        needed = [int(i) for i in ids if i]
        if len(needed) > self.lora_config.max_loras:
            raise ValueError(
                f"a step with {len(needed)} adapters, more than max_loras "
                f"({self.lora_config.max_loras})"
            )
        slots = np.array([self._slot_for(i, needed) if i else -1 for i in ids.tolist()])
        token_slots = np.repeat(slots[inverse], num_scheduled)
        tensor = torch.from_numpy(token_slots.astype(np.int64)).to(self.device)
        self._set_mapping(LoRAMapping(tensor, self.lora_config.max_loras))

    def _set_mapping(self, mapping: LoRAMapping | None) -> None:
        # Read by every layer's delta and by the compiled CPU decoder stack (models.cpu_stack).
        self.step.mapping = mapping

    def _slot_for(self, lora_int_id: int, needed: list[int]) -> int:
        slot = self.slot_of.get(lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_int_id)
            return slot
        request = self.requests.get(lora_int_id)
        if request is None:
            raise ValueError(f"lora_int_id {lora_int_id} came with no LoRARequest")
        adapter = self.add_adapter(request)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        for (layer, target), delta in self.deltas.items():
            delta.set_slot(slot, adapter.weights.get((layer, target)))
        self.slot_of[lora_int_id] = slot
        return slot
