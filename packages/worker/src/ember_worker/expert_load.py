"""Per-expert load statistics of a mixture-of-experts model, as vLLM's EPLB load statistics.

Each ``SparseMoeBlock`` counts, on the device and without a host sync, the (token, choice) slots
its router sends to each expert (``SparseMoeBlock.expert_load``). ``ExpertLoadStats`` gathers
those counters: ``take`` returns the ``[moe layers, experts]`` counts since the last take, summed
over the expert-parallel group (each rank counts only its slice of the tokens there), and
``step`` logs a summary every ``interval`` steps: the tokens routed, each layer's balancedness
(mean over max expert load, 1.0 when even, vLLM's measure) and the hottest expert.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ember_worker.layers.parallel import TensorParallelGroup
from ember_worker.models.moe import SparseMoeBlock

logger = logging.getLogger(__name__)


class ExpertLoadStats:
    """The expert load counters of ``model``'s MoE layers on this rank (``tp``: its group)."""

    def __init__(self, model: nn.Module, tp: TensorParallelGroup, interval: int = 0) -> None:
        check_log_interval(interval)
        self.blocks = [
            (_layer_index(name), module)
            for name, module in model.named_modules()
            if isinstance(module, SparseMoeBlock)
        ]
        self.tp = tp
        self.interval = interval
        self._steps = 0

    @property
    def layers(self) -> list[int]:
        """The decoder layer index of each row of ``take``'s counts."""
        return [index for index, _ in self.blocks]

    def take(self) -> torch.Tensor:
        """``[moe layers, experts]`` int64 on the CPU: slots routed to each expert since the last
        call, over all ranks' tokens; the counters restart. A collective under expert
        parallelism: every rank of the group calls it at the same step."""
        if not self.blocks:
            return torch.zeros((0, 0), dtype=torch.long)
        counts = torch.stack([block.expert_load for _, block in self.blocks])
        for _, block in self.blocks:
            block.expert_load.zero_()
        if self.blocks[0][1].moe.expert_parallel:
            self.tp.all_reduce(counts)
        return counts.cpu()

    def step(self) -> None:
        """Count one model step; every ``interval`` steps, log the load since the last log."""
        if not self.interval or not self.blocks:
            return
        self._steps += 1
        if self._steps % self.interval:
            return
        counts = self.take()
        if self.tp.rank == 0:
            logger.info("%s", describe_load(counts, self.layers, self.interval))


def check_log_interval(interval: object) -> None:
    """ValueError unless ``interval`` (steps between load logs; 0: never) is an int >= 0."""
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ValueError(f"expert_load_log_interval must be an int >= 0, got {interval!r}")


def describe_load(counts: torch.Tensor, layers: list[int], steps: int) -> str:
    """One line: routed slots, mean and worst per-layer balancedness, the hottest expert."""
    per_layer = counts.sum(dim=1)
    if int(per_layer.sum()) == 0:
        return f"expert load over {steps} steps: no tokens routed"
    loads = counts.double()
    balance = loads.mean(dim=1) / loads.max(dim=1).values.clamp(min=1)
    worst = int(balance.argmin())
    share = loads / per_layer.clamp(min=1).unsqueeze(1)
    hot_layer, hot_expert = divmod(int(share.argmax()), counts.shape[1])
    return (
        f"expert load over {steps} steps: {int(per_layer.max())} routed slots per MoE layer; "
        f"balancedness (mean/max) {float(balance.mean()):.3f} on average, "
        f"{float(balance[worst]):.3f} at worst (layer {layers[worst]}); hottest expert "
        f"{hot_expert} of layer {layers[hot_layer]} with "
        f"{100 * float(share[hot_layer, hot_expert]):.1f}% of its slots"
    )


def _layer_index(name: str) -> int:
    """The decoder layer of a module named ``model.layers.<i>.mlp``."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])
