"""One step's model inputs, flattened from the persistent batch into preallocated buffers.

As in vLLM v1's GPU model runner, with numpy and no per-token Python: each scheduled token's row
and its offset within that row's run give its position; the input id and the block id are then
gathered at (row, position) through flat indices into the batch's 2-D buffers (twice as fast as
2-D fancy indexing on a prefill), and the KV slot is
``block id × block_size + position % block_size``.
Off the CPU the host buffers are pinned and copied to device buffers of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember_worker.input_batch import InputBatch

# Tensor views are cached per (rows, tokens) shape; slicing tensors costs more than the math.
_MAX_CACHED_VIEWS = 1024


@dataclass
class ModelInputs:
    """One step's flattened model inputs, as tensors over the scheduled tokens of every row.

    ``query_start_loc[i]:query_start_loc[i+1]`` are row ``i``'s tokens; ``seq_lens[i]`` is its
    context length after this step; ``block_table[i, :cdiv(seq_lens[i], block_size)]`` its valid
    block ids (entries past that are stale and must not be read); ``logits_indices[i]`` the index
    of its last scheduled token, whose logits are sampled.
    """

    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    logits_indices: torch.Tensor  # int64 [num_reqs]
    max_query_len: int
    max_seq_len: int
    num_tokens: int
    # With several KV groups: (slot_mapping, block_table) of each; the fields above are group 0's
    # slots and the interleaved table.
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    # With state groups (a Mamba hybrid): each row's state blocks, which lead its table row
    # (``block_table`` above is then the rest of the row).
    state_blocks: torch.Tensor | None = None


class ModelInputBuffers:
    """Preallocated step buffers of one ``InputBatch``; ``prepare`` fills them for a step."""

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        max_tokens, max_reqs = batch.max_num_batched_tokens, batch.max_num_reqs
        pin = batch.device.type == "cuda"

        def cpu_buffer(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pin)

        self._arange = np.arange(max(max_tokens, max_reqs) + 1, dtype=np.int64)
        self._flat_index = np.empty(max_tokens, dtype=np.int64)
        self._token_ids_flat = batch.token_ids_cpu.reshape(-1)
        self._block_table_flat = batch.block_table_cpu.reshape(-1)
        self._input_ids_t = cpu_buffer(max_tokens, torch.int64)
        self._positions_t = cpu_buffer(max_tokens, torch.int64)
        self._slot_mapping_t = cpu_buffer(max_tokens, torch.int64)
        self._query_start_loc_t = cpu_buffer(max_reqs + 1, torch.int32)
        self._seq_lens_t = cpu_buffer(max_reqs, torch.int32)
        self._logits_indices_t = cpu_buffer(max_reqs, torch.int64)
        self._input_ids_np = self._input_ids_t.numpy()
        self._positions_np = self._positions_t.numpy()
        self._slot_mapping_np = self._slot_mapping_t.numpy()
        self._query_start_loc_np = self._query_start_loc_t.numpy()
        self._seq_lens_np = self._seq_lens_t.numpy()
        self._logits_indices_np = self._logits_indices_t.numpy()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        if batch.device.type != "cpu":
            self._device_buffers = [
                torch.empty_like(buffer, device=batch.device)
                for buffer in self._make_views(max_reqs, max_tokens)
            ]

    def prepare(self) -> ModelInputs:
        """Flatten the scheduled tokens of rows ``0..num_reqs-1`` into model inputs.

        Reads the counts (and draft tokens) that ``InputBatch.set_num_scheduled_tokens`` took for
        this step; the batch is not changed. A row scheduled for 0 tokens gets a placeholder
        logits index.
        """
        batch = self.batch
        n = batch.num_reqs
        num_sched = batch.num_scheduled_tokens[:n].astype(np.int64)
        cu = num_sched.cumsum()
        total = int(cu[-1]) if n else 0
        if total == 0:
            raise ValueError("no tokens scheduled: call InputBatch.set_num_scheduled_tokens first")
        computed = batch.num_computed_tokens[:n].astype(np.int64)
        seq_lens = computed + num_sched

        positions = self._positions_np[:total]
        max_query_len = int(num_sched.max())
        if max_query_len == 1 and total == n:  # every row decodes one token
            req_indices = self._arange[:n]
            positions[:] = computed
        else:
            # Row of each token, and its offset within the row's scheduled run.
            req_indices = self._arange[:n].repeat(num_sched)
            offsets = self._arange[:total] - (cu - num_sched).repeat(num_sched)
            np.add(computed[req_indices], offsets, out=positions)

        block_size = batch.block_size
        index = self._flat_index[:total]
        np.multiply(req_indices, batch.max_model_len, out=index)
        index += positions
        self._input_ids_np[:total] = self._token_ids_flat[index]
        np.multiply(req_indices, batch.max_blocks_per_req, out=index)
        index += batch.num_state_blocks  # the state blocks lead the row
        num_groups = batch.num_kv_groups
        index += (
            positions // block_size if num_groups == 1 else positions // block_size * num_groups
        )
        block_numbers = self._block_table_flat[index]
        slot_mapping = self._slot_mapping_np[:total]
        np.multiply(block_numbers, block_size, out=slot_mapping)
        slot_mapping += positions % block_size
        group_tables = None if num_groups == 1 else self._group_tables(n, index, positions)

        self._query_start_loc_np[1 : n + 1] = cu
        self._seq_lens_np[:n] = seq_lens
        np.maximum(cu - 1, 0, out=self._logits_indices_np[:n])
        views = self._views.get((n, total))
        if views is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            views = self._views[(n, total)] = self._make_views(n, total)
        if batch.device.type != "cpu":
            views = self._copy_to_device(views)
        state_blocks = None
        if batch.num_state_blocks:
            table, states = views[5], batch.num_state_blocks
            state_blocks = table[:, :states].contiguous()
            views = (*views[:5], table[:, states:].contiguous(), *views[6:])
        return ModelInputs(
            *views,
            state_blocks=state_blocks,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            num_tokens=total,
            group_tables=group_tables,
        )

    def _group_tables(self, n: int, index: np.ndarray, positions: np.ndarray) -> tuple:
        """Each KV group's slots and block table: group ``g``'s block of a token sits ``g``
        entries after group 0's in the interleaved row."""
        batch = self.batch
        size, num_groups, device = batch.block_size, batch.num_kv_groups, batch.device
        offsets = positions % size
        table = batch.block_table_cpu_tensor[:n]
        tables = []
        for group in range(num_groups):
            slots = torch.from_numpy(self._block_table_flat[index + group] * size + offsets)
            rows = table[:, batch.num_state_blocks + group :: num_groups].contiguous()
            tables.append((slots.to(device), rows.to(device)))
        return tuple(tables)

    def _make_views(self, n: int, total: int) -> tuple[torch.Tensor, ...]:
        """Tensor views of the buffers for ``n`` rows and ``total`` tokens, in ``ModelInputs``
        order (the block table is the batch's own)."""
        return (
            self._input_ids_t[:total],
            self._positions_t[:total],
            self._slot_mapping_t[:total],
            self._query_start_loc_t[: n + 1],
            self._seq_lens_t[:n],
            self.batch.block_table_cpu_tensor[:n],
            self._logits_indices_t[:n],
        )

    def _copy_to_device(self, views: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        copies = []
        for view, device_buffer in zip(views, self._device_buffers):
            target = device_buffer[: view.shape[0]]
            target.copy_(view, non_blocking=True)
            copies.append(target)
        return tuple(copies)
