"""Checkpoints quantized in the compressed-tensors format (llm-compressor's, as vLLM loads them):
the one scheme Ember runs, W8A8 int8, and a clear refusal of every other.

W8A8 int8: every linear layer the config targets stores an int8 ``weight [out, in]`` and a
``weight_scale [out, 1]``, symmetric with one scale per output channel; activations are quantized
to int8 when the layer runs, one symmetric scale per token (``dynamic``). The ``ignore``d layers
(the LM head) stay in the model's dtype. The config.json field reads, in part::

    "quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"type": "int", "num_bits": 8, "symmetric": true, "strategy": "channel"},
        "input_activations": {"type": "int", "num_bits": 8, "symmetric": true,
                              "strategy": "token", "dynamic": true}}},
      "ignore": ["lm_head"]}
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ember_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, make_w8a8
from ember_worker.quantization import COMPRESSED_TENSORS as QUANT_METHOD

# Both store the int8 values as they are ("naive" is the older name).
W8A8_FORMATS = ("int-quantized", "naive-quantized")
# Field values a W8A8 scheme must have; ``None`` stands for "absent or null".
_WEIGHTS = {
    "type": "int",
    "num_bits": 8,
    "symmetric": True,
    "strategy": "channel",
    "dynamic": False,
    "group_size": None,
}
_INPUT_ACTIVATIONS = {
    "type": "int",
    "num_bits": 8,
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
    "group_size": None,
}
# compressed-tensors' defaults for fields a config leaves out (``QuantizationArgs``).
_DEFAULTS = {"type": "int", "num_bits": 8, "symmetric": True, "group_size": None, "dynamic": False}
# The layers a W8A8 checkpoint may leave in float: the LM head (the linear layers inside the
# decoder are merged, q/k/v and gate/up, and run in one precision).
IGNORABLE = ("lm_head",)
FIELD = "quantization_config"


def checkpoint_quantization(hf_config: Any) -> str | None:
    """``QUANT_METHOD`` for a checkpoint whose config.json holds a W8A8 int8 compressed-tensors
    ``quantization_config``, None for one without any; ValueError naming the field and its value
    for any other quantization (another method, format, bit width, strategy, asymmetric or static
    scales)."""
    config = getattr(hf_config, FIELD, None)
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"{FIELD}: expected an object, got {config!r}")
    _expect(config, "quant_method", (QUANT_METHOD,))
    _expect(config, "format", W8A8_FORMATS)
    _expect(config, "quantization_status", ("compressed", None))
    _expect(config, "kv_cache_scheme", (None,))
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{FIELD}.config_groups: expected one or more groups, got {groups!r}")
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{FIELD}.{where}: expected an object, got {group!r}")
        _expect(group, "targets", (["Linear"],), where)
        _expect(group, "output_activations", (None,), where)
        for key, wanted in (("weights", _WEIGHTS), ("input_activations", _INPUT_ACTIVATIONS)):
            args = group.get(key)
            if not isinstance(args, dict):
                raise ValueError(f"{FIELD}.{where}.{key}: expected an object, got {args!r}")
            for field, value in wanted.items():
                _expect(args, field, (value,), f"{where}.{key}", _DEFAULTS.get(field))
    for entry in config.get("ignore") or []:
        if entry not in IGNORABLE:
            raise ValueError(
                f"{FIELD}.ignore: only {list(IGNORABLE)} may stay unquantized (the decoder's "
                f"merged projections run in one precision), got {entry!r}"
            )
    if "lm_head" not in (config.get("ignore") or []):
        raise ValueError(f"{FIELD}.ignore: an int8 LM head is not supported; expected 'lm_head'")
    return QUANT_METHOD


def _expect(args: dict, field: str, allowed: tuple, where: str = "", default: Any = None) -> None:
    value = args.get(field, default)
    if value not in allowed:
        name = f"{FIELD}.{where}.{field}" if where else f"{FIELD}.{field}"
        shown = [a for a in allowed if a is not None] or [None]
        raise ValueError(f"{name}: Ember runs W8A8 int8 with {shown}, got {value!r}")


def prepare_w8a8(model: nn.Module) -> None:
    """Give every linear layer of the decoder (not the LM head, which stays float) an int8 weight
    and per-channel scales to load a W8A8 checkpoint into (``layers.linear.make_w8a8``)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            make_w8a8(module)


def w8a8_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A W8A8 checkpoint's tensors as the model holds them: ``weight_scale [out, 1]`` flattened
    to ``[out]``; a quantized weight checked to hold int8 values (the naive format may store
    them in a float dtype); zero points, which some writers store for symmetric schemes too,
    dropped where they are all zero (refused otherwise)."""
    for name, tensor in weights:
        if name.endswith("_zero_point"):
            if tensor.any():
                raise ValueError(f"checkpoint tensor {name!r}: nonzero zero points (asymmetric)")
            continue
        if name.endswith(".weight_scale"):
            if tensor.dim() != 2 or tensor.shape[1] != 1:
                raise ValueError(
                    f"checkpoint tensor {name!r}: expected per-channel scales [out, 1], got "
                    f"{tuple(tensor.shape)}"
                )
            tensor = tensor.reshape(-1)
        elif _is_projection_weight(name) and not _holds_int8_values(tensor):
            raise ValueError(f"checkpoint tensor {name!r}: expected int8 values, got floats")
        yield name, tensor


def _is_projection_weight(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _holds_int8_values(tensor: torch.Tensor) -> bool:
    if not tensor.is_floating_point():
        return True
    return torch.equal(tensor, tensor.round()) and bool(tensor.abs().max() <= 128)
