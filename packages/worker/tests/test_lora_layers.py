"""A linear layer's LoRA slots under tensor parallelism: each rank's shard of a column-parallel
layer adds its own rows of the full delta, and key/value heads replicated over a group larger
than their number get the whole key/value delta on every replica."""

from __future__ import annotations

import torch

from ember_kernels.lora import LoRAMapping
from ember_worker.layers.linear import QKVParallelLinear
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup
from ember_worker.lora.layers import LoRALinearDelta, LoRAStepMapping

HIDDEN, HEAD, HEADS, KV_HEADS, RANK = 32, 8, 4, 1, 4


def _delta_output(tp: TensorParallelGroup, slices, x, slots) -> torch.Tensor:
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, tp=tp)
    step = LoRAStepMapping()
    delta = LoRALinearDelta(
        layer,
        (HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD),
        2,
        8,
        step,
        torch.float32,
        torch.device("cpu"),
    )
    delta.set_slot(1, slices)
    step.mapping = LoRAMapping(slots, 2)
    return delta(x, torch.zeros(x.shape[0], sum(layer.shard_sizes)))


def test_column_shards_and_replicated_kv_heads_add_their_part_of_the_full_delta():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(RANK, HIDDEN, generator=gen)
    slices = {
        0: (a, torch.randn(HEADS * HEAD, RANK, generator=gen)),
        2: (a, torch.randn(KV_HEADS * HEAD, RANK, generator=gen)),  # v only: k stays zero
    }
    x = torch.randn(3, HIDDEN, generator=gen)
    slots = torch.tensor([1, -1, 1])
    full = _delta_output(SINGLE_RANK, slices, x, slots)
    q_full, k_full, v_full = full.split([HEADS * HEAD, HEAD, HEAD], dim=1)
    assert full[1].abs().sum() == 0 and k_full.abs().sum() == 0 and v_full.abs().sum() > 0
    size = 4  # one KV head over 4 ranks: replicated 4 times
    for rank in range(size):
        shard = _delta_output(TensorParallelGroup(rank, size, group=object()), slices, x, slots)
        q, k, v = shard.split([HEADS * HEAD // size, HEAD, HEAD], dim=1)
        q_part = q_full[:, rank * HEAD : (rank + 1) * HEAD]
        torch.testing.assert_close(q, q_part)
        torch.testing.assert_close(v, v_full)
        assert k.abs().sum() == 0
