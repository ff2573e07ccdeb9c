"""``quantization`` in the worker: what ``int8_weight_only`` replaces (and leaves in float), that the numbers are those
of the dequantized weights, and that unknown names are refused."""

from __future__ import annotations

import pytest
import torch

from ember_kernels import cpu_ops
from ember_kernels.int8_linear import dequantize_int8, weight_group_size
from ember_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from ember_worker.model_loader import load_model
from ember_worker.models.cpu_stack import build_cpu_stack
from ember_worker.quantization import FLOAT_PROJECTIONS, check_quantization


def _projections(model):
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied LM heads
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weight_only_quantizes_projections_and_head(tiny_model, arch, dtype):
    path = tiny_model(arch, intermediate_size=256)  # down_proj: two groups of 128 inputs
    plain = load_model(path, dtype=dtype)
    int8 = load_model(path, dtype=dtype, pack_weights=True, quantization="int8_weight_only")
    assert int8.dtype == plain.dtype  # activations, norms and KV cache keep the dtype
    for name, module in [*_projections(int8.model), ("lm_head", int8.model.lm_head)]:
        if name.endswith(FLOAT_PROJECTIONS):
            assert module.weight.dtype == plain.dtype and module.weight_scale is None
            continue
        assert module.weight.dtype == torch.int8
        assert module.weight_scale.dtype == torch.float32
        out_features, in_features = module.weight.shape
        groups = in_features // weight_group_size(in_features)
        assert module.weight_scale.shape == (out_features, groups)
    embedding = int8.model.model.embed_tokens.weight
    assert embedding.dtype == plain.dtype and not embedding.is_mkldnn
    torch.testing.assert_close(embedding, plain.model.model.embed_tokens.weight, rtol=0, atol=0)
    # the numbers are those of the plain model on the dequantized weights
    for (name, q_module), (_, f_module) in zip(
        [*_projections(int8.model), ("lm_head", int8.model.lm_head)],
        [*_projections(plain.model), ("lm_head", plain.model.lm_head)],
    ):
        if name.endswith(FLOAT_PROJECTIONS):
            continue
        f_module.weight = torch.nn.Parameter(
            dequantize_int8(q_module.weight, q_module.weight_scale, torch.float32).to(
                f_module.weight.dtype
            ),
            requires_grad=False,
        )
    ids = torch.arange(3, 20)
    hidden = plain.model.model.embed_tokens(ids)
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for layer_index in range(2):
        outs = [m.model.model.layers[layer_index].mlp(hidden) for m in (plain, int8)]
        torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)
    logits = [m.model.compute_logits(hidden) for m in (plain, int8)]
    torch.testing.assert_close(logits[1], logits[0], rtol=tolerance, atol=tolerance)


def test_int8_weights_run_in_the_compiled_stack(tiny_model):
    from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache
    from ember_worker.layers.attention import bind_kv_cache

    loaded = load_model(tiny_model("llama"), dtype="float32", quantization="int8_weight_only")
    c = loaded.config
    spec = KVCacheSpec(c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, torch.float32)
    bind_kv_cache(loaded.model, allocate_kv_cache(spec, 4, torch.device("cpu")))
    stack = build_cpu_stack(list(loaded.model.model.layers))
    assert (stack is not None) == cpu_ops.available()


def test_unknown_quantization_is_refused(tiny_model):
    assert check_quantization(None) is None
    assert check_quantization("int8_weight_only") == "int8_weight_only"
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        load_model(tiny_model("llama"), dtype="float32", quantization="int4")
    with pytest.raises(ValueError, match=r"WorkerConfig\.quantization"):
        check_quantization("fp8", "WorkerConfig.quantization")
