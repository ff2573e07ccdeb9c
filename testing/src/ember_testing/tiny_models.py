"""The test-model factory: tiny random-weight models of every architecture Ember supports.

Each is a real Hugging Face folder written by the server's demo-model writer
(``ember_server.cli.demo_model.random_model_path``: same tokenizer, same cache, same on-disk form),
with the small sizes and the switches of its architecture.
"""

from __future__ import annotations

import pathlib
from typing import Any

from ember_server.cli.demo_model import (
    LLAMA_CONFIG,
    _write_atomically,
    random_model_path,
    tokenizer_path,
)

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# With tied embeddings and small weights the residual stream stays close to the input token's
# embedding, so greedy decoding repeats one or two tokens; larger weights let the layers decide.
_TIED = dict(tie_word_embeddings=True, initializer_range=0.2)
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": LLAMA_CONFIG,
    "mistral": dict(tie_word_embeddings=False, sliding_window=None, head_dim=16),
    "qwen2": dict(_TIED, use_sliding_window=False),  # qkv bias is built in
    "qwen3": dict(_TIED, head_dim=32),  # q/k norm is built in
}

# The benchmarks' Llama of about 30M parameters (with ``tiny_model_path("llama", ...)``): 9 layers of
# hidden 512, 8 query / 4 KV heads of 64, MLP 1536; large enough that a step's compute, not the
# engine's host work, dominates, as in a real model.
BENCH_LLAMA_CONFIG: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=9,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)

# A Qwen2.5-0.5B-shaped model (with ``tiny_model_path("qwen2", ...)``, random weights): the size
# CPU users run, for the benchmarks that compare speed at a real shape.
QWEN_05B_CONFIG: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    initializer_range=0.02,
)

# transformers' *ForSequenceClassification exists for these (Mistral's classifier is not one Ember
# loads); the pad token id (set in every config here) lets HF find each row's last token.
CLASSIFIER_ARCHITECTURES = ("llama", "qwen2", "qwen3")

__all__ = [
    "ARCHITECTURES",
    "BENCH_LLAMA_CONFIG",
    "CLASSIFIER_ARCHITECTURES",
    "QWEN_05B_CONFIG",
    "tiny_classifier_path",
    "tiny_model_path",
    "tiny_w8a8_model_path",
    "tokenizer_path",
]


def tiny_model_path(
    arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> pathlib.Path:
    """Path of a cached tiny float32 model of ``arch``, written on first use.

    ``overrides`` change config fields (sizes, rope scaling, sliding window, ...);
    ``max_shard_size`` (e.g. ``"200KB"``) splits the weights into several safetensors files.
    """
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    return random_model_path(arch, seed, max_shard_size, **{**ARCH_CONFIGS[arch], **overrides})


def tiny_classifier_path(
    arch: str, num_labels: int = 3, seed: int = 0, **overrides: Any
) -> pathlib.Path:
    """Path of a cached tiny float32 ``*ForSequenceClassification`` model of ``arch`` (the same
    decoder as ``tiny_model_path``'s, with a ``score`` head of ``num_labels``)."""
    if arch not in CLASSIFIER_ARCHITECTURES:
        raise ValueError(f"arch must be one of {CLASSIFIER_ARCHITECTURES}, got {arch!r}")
    config = {**ARCH_CONFIGS[arch], "num_labels": num_labels, **overrides}
    return random_model_path(arch, seed, None, sequence_classification=True, **config)


# The linear layers a W8A8 checkpoint quantizes (every one inside the decoder layers).
W8A8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# config.json's quantization_config as llm-compressor writes it for W8A8 int8 (dynamic per-token
# activations, per-channel weights, the LM head left in float).
W8A8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "output_activations": None,
            "weights": dict(
                type="int", num_bits=8, symmetric=True, strategy="channel", dynamic=False,
                group_size=None, observer="minmax", actorder=None, block_structure=None,
            ),
            "input_activations": dict(
                type="int", num_bits=8, symmetric=True, strategy="token", dynamic=True,
                group_size=None, observer=None, actorder=None, block_structure=None,
            ),
        }
    },
}  # fmt: skip


def tiny_w8a8_model_path(arch: str, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Path of a cached W8A8 int8 compressed-tensors checkpoint made from ``tiny_model_path(arch,
    seed, **overrides)``: each projection's weight quantized symmetrically per output channel to
    an int8 ``weight`` and a float32 ``weight_scale [out, 1]``, the rest as it was."""
    source = tiny_model_path(arch, seed, **overrides)
    return _write_atomically(
        source.parent / f"{source.name}-w8a8-v1", lambda out: _write_w8a8(source, out)
    )


def _write_w8a8(source: pathlib.Path, out: pathlib.Path) -> None:
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.endswith(".weight") and name.split(".")[-2] in W8A8_PROJECTIONS:
                amax = tensor.float().abs().amax(dim=1, keepdim=True)
                scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
                q = torch.round(tensor.float() / scale).clamp(-127, 127).to(torch.int8)
                tensors[name] = q.contiguous()
                tensors[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
            else:
                tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy2(item, out / item.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = W8A8_QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2))
