"""Compressed-tensors W8A8 int8 checkpoints in the worker: the config that is recognised and
every other refused naming its field, and the int8 weights and per-channel scales loaded into
the merged projections as the checkpoint holds them, whole and as a tensor-parallel shard."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from ember_testing.tiny_models import W8A8_QUANTIZATION_CONFIG, tiny_w8a8_model_path
from ember_worker.compressed_tensors import checkpoint_quantization, w8a8_tensors
from ember_worker.hf_config import HFConfig
from ember_worker.layers.parallel import TensorParallelGroup
from ember_worker.model_loader import load_model
from ember_worker.quantization import resolve_quantization


def _config(**changes):
    config = copy.deepcopy(W8A8_QUANTIZATION_CONFIG)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = config
        for key in parents:
            target = target[key]
        target[leaf] = value
    return HFConfig(quantization_config=config)


def test_recognises_w8a8_and_nothing_for_a_float_checkpoint():
    assert checkpoint_quantization(_config()) == "compressed-tensors"
    assert checkpoint_quantization(_config(format="naive-quantized")) == "compressed-tensors"
    assert checkpoint_quantization(HFConfig()) is None


W = "config_groups__group_0__weights__"
A = "config_groups__group_0__input_activations__"


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method"),
        ({"format": "float-quantized"}, "quantization_config.format"),
        ({"format": "pack-quantized"}, "quantization_config.format"),
        ({W + "symmetric": False}, "group_0.weights.symmetric"),
        ({W + "strategy": "group", W + "group_size": 128}, "group_0.weights.strategy"),
        ({W + "num_bits": 4}, "group_0.weights.num_bits"),
        ({W + "type": "float"}, "group_0.weights.type"),
        ({A + "dynamic": False}, "group_0.input_activations.dynamic"),
        ({A + "strategy": "tensor"}, "group_0.input_activations.strategy"),
        ({A + "symmetric": False}, "group_0.input_activations.symmetric"),
        ({"config_groups__group_0__input_activations": None}, "group_0.input_activations"),
        ({"config_groups__group_0__targets": ["Embedding"]}, "group_0.targets"),
        ({"kv_cache_scheme": {"num_bits": 8}}, "quantization_config.kv_cache_scheme"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "quantization_config.ignore"),
        ({"ignore": []}, "quantization_config.ignore"),
    ],
)
def test_refuses_any_other_scheme_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        checkpoint_quantization(_config(**changes))


def test_quantization_argument_must_agree_with_the_checkpoint():
    assert resolve_quantization(None, "compressed-tensors") == "compressed-tensors"
    assert resolve_quantization("compressed-tensors", "compressed-tensors") == "compressed-tensors"
    assert resolve_quantization("int8_weight_only", None) == "int8_weight_only"
    with pytest.raises(ValueError, match="quantization: the checkpoint is already quantized"):
        resolve_quantization("int8_weight_only", "compressed-tensors")
    with pytest.raises(ValueError, match="quantization: 'compressed-tensors' needs"):
        resolve_quantization("compressed-tensors", None)


def _checkpoint(path, layer, name):
    tensors = load_file(path / "model.safetensors")
    prefix = f"model.layers.{layer}."
    return tensors[prefix + name + ".weight"], tensors[prefix + name + ".weight_scale"].flatten()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loads_int8_weights_and_scales_into_merged_projections(dtype):
    path = tiny_w8a8_model_path("qwen2")
    loaded = load_model(path, dtype=dtype, pack_weights=True)
    layer = loaded.model.model.layers[1]
    parts = [_checkpoint(path, 1, f"self_attn.{p}_proj") for p in "qkv"]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([w for w, _ in parts]))
    assert torch.equal(layer.self_attn.qkv_proj.weight_scale, torch.cat([s for _, s in parts]))
    parts = [_checkpoint(path, 1, f"mlp.{p}_proj") for p in ("gate", "up")]
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([w for w, _ in parts]))
    assert torch.equal(layer.mlp.gate_up_proj.weight_scale, torch.cat([s for _, s in parts]))
    down = layer.mlp.down_proj
    assert (down.weight.dtype, down.weight_scale.dtype) == (torch.int8, torch.float32)
    assert down.quantize_activations and layer.self_attn.qkv_proj.quantize_activations
    assert loaded.model.lm_head.weight.dtype == loaded.dtype  # ignored: stays float
    hidden = torch.randn(3, loaded.config.hidden_size, dtype=loaded.dtype)
    assert layer.mlp.gate_up_proj(hidden).dtype == loaded.dtype


def test_tensor_parallel_rank_holds_its_rows_and_columns():
    path = tiny_w8a8_model_path("llama")
    # Loading calls no collective; the group object is never used.
    tp = TensorParallelGroup(rank=1, size=2, group=object())
    shard = load_model(path, dtype="float32", tp=tp).model.model.layers[0]
    q, q_scale = _checkpoint(path, 0, "self_attn.q_proj")
    rows = q.shape[0] // 2
    assert torch.equal(shard.self_attn.qkv_proj.weight[:rows], q[rows:])
    assert torch.equal(shard.self_attn.qkv_proj.weight_scale[:rows], q_scale[rows:])
    down, down_scale = _checkpoint(path, 0, "mlp.down_proj")
    columns = down.shape[1] // 2
    assert torch.equal(shard.mlp.down_proj.weight, down[:, columns:])
    assert torch.equal(shard.mlp.down_proj.weight_scale, down_scale)  # per output row: whole


def test_refuses_an_int8_lm_head_checkpoint_at_load(tmp_path):
    source = tiny_w8a8_model_path("llama")
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["ignore"] = []
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.ignore"):
        load_model(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match="quantization: the checkpoint is already quantized"):
        load_model(source, dtype="float32", quantization="int8_weight_only")


def test_checkpoint_tensors_are_checked_and_scales_flattened():
    scale = torch.rand(6, 1)
    naive = torch.randint(-127, 128, (6, 4)).float()  # the naive format may store int8 in floats
    name = "model.layers.0.self_attn.q_proj."
    tensors = dict(w8a8_tensors([(name + "weight", naive), (name + "weight_scale", scale)]))
    assert torch.equal(tensors[name + "weight"], naive)
    assert torch.equal(tensors[name + "weight_scale"], scale.flatten())
    with pytest.raises(ValueError, match="expected int8 values"):
        list(w8a8_tensors([(name + "weight", naive + 0.5)]))
    with pytest.raises(ValueError, match=r"expected per-channel scales \[out, 1\]"):
        list(w8a8_tensors([(name + "weight_scale", torch.rand(6, 2))]))
    zero_point = (name + "weight_zero_point", torch.zeros(6, 1, dtype=torch.int8))
    assert list(w8a8_tensors([zero_point])) == []  # symmetric: nothing to hold
    with pytest.raises(ValueError, match="nonzero zero points"):
        list(w8a8_tensors([(zero_point[0], torch.ones(6, 1, dtype=torch.int8))]))
    norm = ("model.layers.0.input_layernorm.weight", torch.rand(4))
    assert list(w8a8_tensors([norm])) == [norm]  # not quantized: left as it is
