"""The Mamba-2 mixer of an attention / Mamba hybrid, over the engine's flat batch.

Each request's conv window and SSM state live in its state slot (``ember_worker.mamba_state``:
the slot of the state block the KV cache's state group gave it) in every mixer's tensors. A step's
requests split once (``MambaStepMetadata``) into those scheduled one token (decode: the fused
state update) and those scheduled several (prefill chunks: the chunked scan); a request's first
chunk starts from a zero state, a later one from the state its last chunk left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ember_kernels import mamba as mamba_ops
from ember_worker.layers.attention import AttentionMetadata
from ember_worker.models.mamba_config import MambaHybridConfig


@dataclass
class MambaStepMetadata:
    """Where each request's tokens and state are this step (rows scheduled no token left out):
    ``slots``, ``query_start_loc`` and ``has_initial_state`` of every row with tokens; then the
    decode rows' tokens (one each) and the prefill rows' tokens and their own start offsets."""

    slots: torch.Tensor
    query_start_loc: torch.Tensor
    has_initial_state: torch.Tensor
    decode_tokens: torch.Tensor | None
    decode_rows: torch.Tensor | None
    prefill_tokens: torch.Tensor | None
    prefill_rows: torch.Tensor | None
    prefill_query_start_loc: torch.Tensor | None

    @classmethod
    def build(cls, metadata: AttentionMetadata) -> MambaStepMetadata:
        """From the step's attention metadata: one pass over the rows, no per-row loop."""
        if metadata.state_slots is None:
            raise RuntimeError("a Mamba layer needs the step's state slots (state_slots)")
        qsl = metadata.query_start_loc.long()
        lengths = qsl[1:] - qsl[:-1]
        device = qsl.device
        active = torch.nonzero(lengths > 0).flatten()
        lengths = lengths[active]
        starts = qsl[:-1][active]
        computed = metadata.seq_lens.long()[active] - lengths
        active_qsl = F.pad(torch.cumsum(lengths, 0), (1, 0))
        is_decode = lengths == 1
        decode_rows = torch.nonzero(is_decode).flatten()
        prefill_rows = torch.nonzero(~is_decode).flatten()
        prefill_tokens = prefill_qsl = None
        if prefill_rows.numel():
            prefill_lengths = lengths[prefill_rows]
            prefill_qsl = F.pad(torch.cumsum(prefill_lengths, 0), (1, 0))
            total = int(prefill_qsl[-1])
            rows = torch.arange(prefill_rows.numel(), device=device).repeat_interleave(
                prefill_lengths, output_size=total
            )
            offsets = torch.arange(total, device=device) - prefill_qsl[:-1][rows]
            prefill_tokens = starts[prefill_rows][rows] + offsets
        return cls(
            slots=metadata.state_slots[active, 0].long(),
            query_start_loc=active_qsl,
            has_initial_state=computed > 0,
            decode_tokens=starts[decode_rows] if decode_rows.numel() else None,
            decode_rows=decode_rows if decode_rows.numel() else None,
            prefill_tokens=prefill_tokens,
            prefill_rows=prefill_rows if prefill_rows.numel() else None,
            prefill_query_start_loc=prefill_qsl,
        )


class Mamba2Mixer(nn.Module):
    """in_proj -> causal conv1d (+SiLU) -> selective state-space scan (+D skip) -> RMSNorm
    gated by SiLU(z), per group of channels -> out_proj. Checkpoint names are HF Bamba's."""

    def __init__(self, config: MambaHybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.mamba_heads
        self.head_dim = config.mamba_head_dim
        self.groups = config.mamba_groups
        self.state_size = config.mamba_state
        self.intermediate = config.mamba_intermediate
        self.conv_channels = config.mamba_conv_channels
        self.chunk_size = config.mamba_chunk_size
        self.dt_limit = config.mamba_dt_limit
        self.eps = config.rms_norm_eps
        projection = self.intermediate + self.conv_channels + self.num_heads
        bias = config.mamba_proj_bias
        self.in_proj = nn.Linear(config.hidden_size, projection, bias=bias, dtype=dtype)
        self.conv1d = nn.Conv1d(
            self.conv_channels,
            self.conv_channels,
            config.mamba_conv_width,
            groups=self.conv_channels,
            bias=config.mamba_conv_bias,
            dtype=dtype,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.ones(self.num_heads, dtype=dtype))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.intermediate, dtype=dtype))
        self.out_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias, dtype=dtype)
        for param in self.parameters():
            param.requires_grad_(False)
        # (conv window [slots, channels, width - 1], SSM state [slots, heads, head_dim, state]),
        # bound by ember_worker.mamba_state.bind_mamba_state.
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden_states: torch.Tensor, step: MambaStepMetadata) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("Mamba2Mixer has no state bound; call bind_mamba_state first")
        conv_state, ssm_state = self.state
        num_tokens = hidden_states.shape[0]
        gate, xbc, dt = self.in_proj(hidden_states).split(
            [self.intermediate, self.conv_channels, self.num_heads], dim=-1
        )
        xbc = mamba_ops.causal_conv1d_varlen(
            xbc,
            self.conv1d.weight[:, 0],
            self.conv1d.bias,
            conv_state,
            step.slots,
            step.query_start_loc,
            step.has_initial_state,
        )
        group_width = self.groups * self.state_size
        x, B, C = xbc.split([self.intermediate, group_width, group_width], dim=-1)
        x = x.reshape(num_tokens, self.num_heads, self.head_dim)
        B = B.reshape(num_tokens, self.groups, self.state_size)
        C = C.reshape(num_tokens, self.groups, self.state_size)
        A = -torch.exp(self.A_log.float())
        y = torch.empty_like(x)
        if step.decode_tokens is not None:
            t, rows = step.decode_tokens, step.decode_rows
            y[t] = mamba_ops.selective_state_update(
                ssm_state, x[t], dt[t], A, B[t], C[t], self.D, self.dt_bias, step.slots[rows],
                step.has_initial_state[rows], self.dt_limit,
            )  # fmt: skip
        if step.prefill_tokens is not None:
            t, rows = step.prefill_tokens, step.prefill_rows
            y[t] = mamba_ops.ssd_chunk_scan_varlen(
                x[t], dt[t], A, B[t], C[t], self.D, self.dt_bias, ssm_state, step.slots[rows],
                step.prefill_query_start_loc, step.has_initial_state[rows], self.chunk_size,
                self.dt_limit,
            )  # fmt: skip
        y = self._gated_norm(y.reshape(num_tokens, self.intermediate), gate)
        return self.out_proj(y)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``y * silu(gate)`` over each group's channels, in float32, then scaled."""
        gated = y.float() * F.silu(gate.float())
        grouped = gated.view(gated.shape[0], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.weight * grouped.view_as(gated).to(y.dtype)
