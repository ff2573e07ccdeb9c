"""A LoRA adapter read from a PEFT folder (``adapter_config.json`` plus
``adapter_model.safetensors``) and checked against the decoder it will run on.

Each projection's low-rank pair is kept as full (unsharded) host tensors, ``A [r, in]`` and
``B [out, r]`` with the adapter's scale (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` under
rsLoRA) folded into ``B``, keyed by the decoder's merged layers: the query, key and value
projections are the slices of ``qkv_proj``, gate and up those of ``gate_up_proj``. An adapter
trained against a fused projection (``qkv_proj``, ``gate_up_proj``) gives each slice the shared
``A`` and its own rows of ``B``.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch

from ember_scheduler.lora import LoRARequest
from ember_worker.models.config import DecoderConfig

# PEFT module name -> (decoder layer that holds it, the slices of that layer it covers).
TARGET_MODULES: dict[str, tuple[str, tuple[int, ...]]] = {
    "q_proj": ("self_attn.qkv_proj", (0,)),
    "k_proj": ("self_attn.qkv_proj", (1,)),
    "v_proj": ("self_attn.qkv_proj", (2,)),
    "qkv_proj": ("self_attn.qkv_proj", (0, 1, 2)),
    "o_proj": ("self_attn.o_proj", (0,)),
    "gate_proj": ("mlp.gate_up_proj", (0,)),
    "up_proj": ("mlp.gate_up_proj", (1,)),
    "gate_up_proj": ("mlp.gate_up_proj", (0, 1)),
    "down_proj": ("mlp.down_proj", (0,)),
}
_TENSOR_NAME = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# Settings PEFT writes that change what the weights mean; refused unless at their no-op value.
_REFUSED_SETTINGS = {
    "bias": ("none", None),
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "fan_in_fan_out": (False, None),
}


def slice_sizes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Output sizes of each slice of the decoder's projections (full, unsharded), and, for the
    row-parallel ``o_proj``/``down_proj``, their one slice."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "self_attn.qkv_proj": (q, kv, kv),
        "self_attn.o_proj": (config.hidden_size,),
        "mlp.gate_up_proj": (inter, inter),
        "mlp.down_proj": (config.hidden_size,),
    }


def input_sizes(config: DecoderConfig) -> dict[str, int]:
    q = config.num_attention_heads * config.head_dim
    return {
        "self_attn.qkv_proj": config.hidden_size,
        "self_attn.o_proj": q,
        "mlp.gate_up_proj": config.hidden_size,
        "mlp.down_proj": config.intermediate_size,
    }


@dataclass
class LoRAAdapter:
    """An adapter's weights on the host: ``weights[(layer, module)][slice] = (A, B * scale)``
    for each slice it adapts (``module`` as in ``TARGET_MODULES``' values)."""

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def _error(request: LoRARequest, field: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {field}: {why}")


def read_adapter_config(request: LoRARequest) -> dict:
    folder = pathlib.Path(request.lora_path)
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise _error(request, "lora_path", "no adapter_config.json in the folder")
    return json.loads(path.read_text())


def load_adapter(
    request: LoRARequest, config: DecoderConfig, max_lora_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read and check an adapter for a decoder of ``config``; ValueError naming the adapter and
    the field for an adapter that cannot run on it (a rank above ``max_lora_rank``, a module
    other than the attention and MLP projections, a tensor of another base model's shape)."""
    settings = read_adapter_config(request)
    if settings.get("peft_type", "LORA") != "LORA":
        raise _error(request, "peft_type", f"{settings.get('peft_type')!r} is not LORA")
    for field, allowed in _REFUSED_SETTINGS.items():
        if settings.get(field) not in allowed:
            raise _error(request, field, f"{settings[field]!r} is not supported")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise _error(request, "r", f"must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise _error(request, "r", f"rank {rank} is above max_lora_rank {max_lora_rank}")
    targets = settings.get("target_modules") or []
    if isinstance(targets, str):
        targets = []  # a regex: the tensor names below are checked one by one
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise _error(
            request,
            "target_modules",
            f"{unknown} are not among the supported modules {sorted(TARGET_MODULES)}",
        )
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_tensors(request)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.search(name)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise _error(request, "target_modules", f"tensor {name!r} adapts an unsupported module")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.num_hidden_layers:
            raise _error(
                request,
                "base_model_name_or_path",
                f"tensor {name!r} is for layer {layer}, the model has {config.num_hidden_layers}",
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    sizes, inputs = slice_sizes(config), input_sizes(config)
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise _error(
                request, "target_modules", f"layer {layer} {module} lacks lora_A or lora_B"
            )
        target, slices = TARGET_MODULES[module]
        a, b = pair["A"], pair["B"]
        out = sum(sizes[target][i] for i in slices)
        expected_a, expected_b = (rank, inputs[target]), (out, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise _error(
                request,
                "base_model_name_or_path",
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                f"not fit this model (expected {expected_a} and {expected_b})",
            )
        a, b = a.to(dtype), (b.double() * scale).to(dtype)
        split = b.split([sizes[target][i] for i in slices])
        entry = weights.setdefault((layer, target), {})
        for index, b_slice in zip(slices, split):
            if index in entry:
                raise _error(
                    request, "target_modules", f"layer {layer}: {module} adapts a slice twice"
                )
            entry[index] = (a, b_slice.contiguous())
    if not weights:
        raise _error(request, "target_modules", "the adapter holds no LoRA weights")
    return LoRAAdapter(request, rank, scale, weights)


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = pathlib.Path(request.lora_path)
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise _error(request, "lora_path", "no adapter_model.safetensors in the folder")
    return load_file(path)
