"""Loading Hugging Face folders: shards, dtypes, tied embeddings, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ember_kernels import cpu_features
from ember_kernels.packed_linear import packable_dtypes
from ember_worker.hf_config import load_hf_config
from ember_worker.layers import linear as linear_layers
from ember_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from ember_worker.layers.parallel import TensorParallelGroup
from ember_worker.model_loader import (
    choose_dtype,
    load_model,
    resolve_model_path,
    safetensors_files,
)


def _checkpoint(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in safetensors_files(path):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_checkpoint_loads_the_same_weights(tiny_model, arch):
    sharded = tiny_model(arch, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    one = load_model(tiny_model(arch), dtype="float32").model.state_dict()
    many = load_model(sharded, dtype="float32").model.state_dict()
    assert one.keys() == many.keys()
    for name in one:
        assert torch.equal(one[name], many[name]), name


def test_merged_projections_hold_the_checkpoint_tensors(tiny_model):
    path = tiny_model("qwen2")  # qkv bias, tied embeddings
    ckpt = _checkpoint(path)
    loaded = load_model(path, dtype="float32")
    layer = loaded.model.model.layers[1]
    qkv = torch.cat([ckpt[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    bias = torch.cat([ckpt[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.bias, bias)
    gate_up = torch.cat([ckpt[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_untied_lm_head_is_its_own_tensor(tiny_model):
    path = tiny_model("llama")
    loaded = load_model(path, dtype="float32")
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.model.lm_head.weight, _checkpoint(path)["lm_head.weight"])
    assert loaded.config.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_selection(tiny_model, dtype, expected):
    model = load_model(tiny_model("mistral"), dtype=dtype).model
    assert {p.dtype for p in model.parameters()} == {expected}


def test_bad_dtype_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model("llama"), dtype="int8")


@pytest.mark.parametrize(
    ("architecture", "model_type"),
    [("GPT2LMHeadModel", "gpt2"), ("OddForCausalLM", "odd-model")],
    ids=["unsupported_architecture", "unknown_model_type"],
)
def test_unsupported_architecture_is_named(tiny_model, tmp_path, architecture, model_type):
    folder = tmp_path / model_type
    shutil.copytree(tiny_model("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=[architecture], model_type=model_type)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=architecture):
        load_model(folder, dtype="float32")


def test_missing_tensor_is_reported(tiny_model, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "partial"
    shutil.copytree(tiny_model("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k\]|qkv_proj"):
        load_model(folder, dtype="float32")


def test_name_that_is_no_folder_fails_clearly_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError, match="no-such-org/no-such-model"):
        resolve_model_path("no-such-org/no-such-model", local_files_only=True)


def test_hub_download_failure_names_the_model(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    # A closed local port: the download fails at once, with no network involved.
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError, match=r"no-such-org/no-such-model.*could not be fetched"):
        resolve_model_path("no-such-org/no-such-model")


def test_a_tensor_parallel_group_needs_a_process_group():
    with pytest.raises(ValueError, match="size 2 needs a torch"):
        TensorParallelGroup(rank=0, size=2)
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallelGroup(rank=1, size=1)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied LM heads
def test_packed_weights_replace_the_plain_ones_and_keep_the_numbers(tiny_model, arch, monkeypatch):
    path = tiny_model(arch)
    by_size = load_model(path, dtype="float32", pack_weights=True)
    for module in by_size.model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            big = module.weight.numel() >= linear_layers.MIN_PACKED_ELEMENTS[torch.float32]
            assert module.weight.is_mkldnn == big
    monkeypatch.setitem(linear_layers.MIN_PACKED_ELEMENTS, torch.float32, 0)
    plain = load_model(path, dtype="float32")
    packed = load_model(path, dtype="float32", pack_weights=True)
    projections = [
        m for m in packed.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert projections and all(m.weight.is_mkldnn for m in projections)
    head, embedding = packed.model.lm_head, packed.model.model.embed_tokens
    assert head.weight.is_mkldnn  # a tied head as a copy: the embedding stays plain
    assert not embedding.weight.is_mkldnn
    ids = torch.arange(3, 40)
    hidden = [m.model.model.embed_tokens(ids) for m in (plain, packed)]
    for layer_index in range(2):
        x = [m.model.model.layers[layer_index].mlp(h) for m, h in zip((plain, packed), hidden)]
        torch.testing.assert_close(x[1], x[0], rtol=1e-5, atol=1e-5)
    logits = [m.model.compute_logits(hidden[0]) for m in (plain, packed)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    bf16 = load_model(path, dtype="bfloat16", pack_weights=True)
    bf16_packs = torch.bfloat16 in packable_dtypes()  # a CPU with bfloat16 dot products
    assert all(
        m.weight.is_mkldnn == bf16_packs
        for m in bf16.model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    )
    assert bf16.model.lm_head.weight.is_mkldnn == bf16_packs
    assert not bf16.model.model.embed_tokens.weight.is_mkldnn
    if bf16_packs:
        plain_bf16 = load_model(path, dtype="bfloat16")
        torch.testing.assert_close(
            bf16.model.compute_logits(hidden[0].bfloat16()),
            plain_bf16.model.compute_logits(hidden[0].bfloat16()),
            rtol=2e-2,
            atol=2e-2,
        )


def test_auto_dtype_runs_float16_checkpoints_as_bfloat16_on_cpus_without_float16(
    tiny_model, monkeypatch
):
    config = load_hf_config(tiny_model("llama"))
    config.dtype = "float16"
    monkeypatch.setattr(cpu_features, "has_fp16_arithmetic", lambda: False)
    dtype, why = choose_dtype("auto", config, "cpu")
    assert dtype == torch.bfloat16 and "no float16 arithmetic" in why
    assert choose_dtype("float16", config, "cpu") == (torch.float16, "asked for")
    monkeypatch.setattr(cpu_features, "has_fp16_arithmetic", lambda: True)
    assert choose_dtype("auto", config, "cpu")[0] == torch.float16
    config.dtype = "bfloat16"
    assert choose_dtype("auto", config, "cpu") == (torch.bfloat16, "auto: the checkpoint's dtype")


def test_auto_dtype_runs_float32_checkpoints_as_bfloat16_where_the_cpu_has_bf16_dot_products(
    tiny_model, monkeypatch
):
    config = load_hf_config(tiny_model("llama"))
    config.dtype = "float32"
    monkeypatch.setattr(cpu_features, "has_bf16_arithmetic", lambda: True)
    dtype, why = choose_dtype("auto", config, "cpu")
    assert dtype == torch.bfloat16 and "native bfloat16" in why
    assert choose_dtype("float32", config, "cpu") == (torch.float32, "asked for")
    monkeypatch.setattr(cpu_features, "has_bf16_arithmetic", lambda: False)
    assert choose_dtype("auto", config, "cpu") == (torch.float32, "auto: the checkpoint's dtype")
