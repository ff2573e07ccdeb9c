"""A Hugging Face model folder's configuration, read as transformers reads it, without transformers.

transformers 5 imports torch with any of its configuration classes whenever torch is installed:
``AutoConfig`` was the longest leg of the engine core's start-up, and put torch into the API
server, which needs neither. For the model types Ember runs, the fields a config.json leaves
out get the defaults of their transformers class here, and the classes' rules (head size, the
windowed layers, the RoPE parameters, the labels) are applied as they apply them;
``tests/test_hf_config.py`` holds every field Ember reads to ``AutoConfig`` over many variants.
"""

from __future__ import annotations

import json
import os
import pathlib
import types
from typing import Any

_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
_CONFIG_FILES = ["*.json"]

_LLAMA_SHAPE = dict(
    vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=None,
)  # fmt: skip
_QWEN_SHAPE = dict(
    _LLAMA_SHAPE, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
    max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
    max_window_layers=28, layer_types=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
# The MoE classes derive these differently from Qwen2/3; Ember refuses their sliding windows.
_QWEN_WINDOW_FIELDS = ("sliding_window", "layer_types", "max_window_layers")

_GEMMA_SHAPE = dict(
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
    attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, layer_types=None,
)  # fmt: skip

# model_type -> the defaults of its transformers config class, for the fields Ember reads.
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _LLAMA_SHAPE, intermediate_size=11008, num_key_value_heads=None,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(
        _LLAMA_SHAPE, intermediate_size=14336, num_key_value_heads=8,
        max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, sliding_window=4096,
    ),
    "qwen2": {k: v for k, v in _QWEN_SHAPE.items() if k != "head_dim"},
    "qwen3": dict(_QWEN_SHAPE, head_dim=128, attention_bias=False),
    "gemma2": dict(_GEMMA_SHAPE, vocab_size=256000, max_position_embeddings=8192,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(_GEMMA_SHAPE, vocab_size=262208, max_position_embeddings=131072,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    ),
    "mixtral": dict(
        _LLAMA_SHAPE, intermediate_size=14336, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, sliding_window=None,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        {k: v for k, v in _QWEN_SHAPE.items() if k not in (*_QWEN_WINDOW_FIELDS, "head_dim")},
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], qkv_bias=True,
    ),
    "qwen3_moe": dict(
        {k: v for k, v in _QWEN_SHAPE.items() if k not in (*_QWEN_WINDOW_FIELDS, "head_dim")},
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, sliding_window=None, attention_bias=False, num_local_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "deepseek_v2": dict(
        _LLAMA_SHAPE, vocab_size=102400, intermediate_size=11008, num_key_value_heads=None,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, attention_bias=False,
        mlp_bias=False, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
        n_group=None, topk_group=None, topk_method="greedy", n_routed_experts=64,
        n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        routed_scaling_factor=1.0, norm_topk_prob=False, num_experts_per_tok=None,
        moe_intermediate_size=1407,
    ),
    "deepseek_v3": dict(
        _LLAMA_SHAPE, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, attention_bias=False,
        first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, n_group=8, topk_group=4,
        n_routed_experts=256, n_shared_experts=1, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True, num_experts_per_tok=8,
        moe_intermediate_size=2048, rope_interleave=True,
    ),
    "bamba": dict(
        {k: v for k, v in _LLAMA_SHAPE.items() if k != "head_dim"}, vocab_size=128000, intermediate_size=14336, num_key_value_heads=8,
        rms_norm_eps=1e-5, max_position_embeddings=262144, bos_token_id=1, eos_token_id=2,
        attention_bias=False, mlp_bias=False, attn_layer_indices=None, mamba_n_heads=128,
        mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
        time_step_limit=(0.0, float("inf")),
    ),
}  # fmt: skip
# model_type -> {name a config.json may use: the name its transformers class stores it under}.
_ATTRIBUTE_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts"},
}
# Model types whose transformers class defaults ``rope_theta`` to other than 10,000.
_DEFAULT_ROPE_THETA = {"mixtral": 1e6, "gemma3_text": 1e6}


# RoPE types whose parameters carry the context length the model was trained on.
_LONG_CONTEXT_ROPE = ("llama3", "yarn", "longrope")


class HFConfig(types.SimpleNamespace):
    """A model's config.json as attributes, completed as its transformers config class would."""


def resolve_model_path(
    model: str | os.PathLike,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    config_only: bool = False,
) -> pathlib.Path:
    """A local folder as is; otherwise a Hugging Face hub repo id, resolved by ``huggingface_hub``
    (its local cache first): the whole model, or with ``config_only`` its JSON files alone (the
    API server's need, beside the engine fetching the weights). Raises OSError naming the model
    when neither works."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = _CONFIG_FILES if config_only else _HUB_FILES
    try:
        folder = snapshot_download(
            str(model), revision=revision, allow_patterns=patterns, local_files_only=True
        )
    except Exception as cached_error:
        if local_files_only:
            raise OSError(
                f"model {str(model)!r} is not a local folder and not in the Hugging Face cache "
                f"({type(cached_error).__name__}: {cached_error})"
            ) from cached_error
        try:
            folder = snapshot_download(str(model), revision=revision, allow_patterns=patterns)
        except Exception as error:
            raise OSError(
                f"model {str(model)!r} is not a local folder and could not be fetched from the "
                f"Hugging Face hub ({type(error).__name__}: {error})"
            ) from error
    return pathlib.Path(folder)


def _read_json(file: pathlib.Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds {type(value).__name__}, not a JSON object")
    return value


def load_hf_config(folder: str | os.PathLike) -> HFConfig:
    """The config.json of a model folder, with its model type's defaults and rules applied.

    OSError when the folder has no config.json; ValueError when it is not JSON or its model type
    is not one Ember runs."""
    file = pathlib.Path(folder) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json (not a Hugging Face model folder)")
    return hf_config_from_dict(_read_json(file))


def hf_config_from_dict(raw: dict[str, Any]) -> HFConfig:
    """``raw`` (a config.json's contents) completed as its transformers config class would."""
    model_type = raw.get("model_type")
    defaults = MODEL_TYPE_DEFAULTS.get(model_type)
    if defaults is None:
        raise ValueError(
            f"model type {model_type!r} (architectures {raw.get('architectures')}) is not "
            f"supported; Ember runs model types {sorted(MODEL_TYPE_DEFAULTS)}"
        )
    raw = dict(raw)
    for alias, name in _ATTRIBUTE_ALIASES.get(model_type, {}).items():
        if alias in raw:
            raw.setdefault(name, raw.pop(alias))
    config = {**defaults, **raw}
    config.setdefault("rope_theta", _DEFAULT_ROPE_THETA.get(model_type, 10000.0))
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    if model_type in ("deepseek_v2", "deepseek_v3"):  # the rotary part of a query/key head
        config["head_dim"] = config["qk_rope_head_dim"]
    if model_type in ("llama", "mistral") and config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        if not config["use_sliding_window"]:
            config["sliding_window"] = None
        if config["layer_types"] is None:
            config["layer_types"] = [
                "sliding_attention"
                if config["sliding_window"] is not None and i >= config["max_window_layers"]
                else "full_attention"
                for i in range(config["num_hidden_layers"])
            ]
    if model_type in ("gemma2", "gemma3_text") and config["layer_types"] is None:
        # Interleaved local and global layers: layer i is global where i + 1 is a multiple of
        # the pattern (every second layer in Gemma 2).
        pattern = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern", 6))
        config["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
    if model_type == "bamba":
        _complete_bamba(config)
    config["dtype"] = raw.get("dtype") or raw.get("torch_dtype")
    if model_type == "gemma3_text":
        config["rope_parameters"] = _local_global_rope_parameters(config)
    else:
        config["rope_parameters"] = _rope_parameters(config)
    id2label = raw.get("id2label")
    if id2label is None:
        id2label = {i: f"LABEL_{i}" for i in range(int(raw.get("num_labels") or 2))}
    config["id2label"] = {int(k): v for k, v in id2label.items()}
    config["num_labels"] = len(config["id2label"])
    return HFConfig(**config)


def _complete_bamba(config: dict[str, Any]) -> None:
    """BambaConfig's rules: the Mamba head size from the expansion, RoPE on half of each head,
    and each layer's kind from ``attn_layer_indices`` (the rest are Mamba layers)."""
    if config["mamba_d_head"] == "auto":
        config["mamba_d_head"] = (
            config["mamba_expand"] * config["hidden_size"] // config["mamba_n_heads"]
        )
    config["partial_rotary_factor"] = 0.5
    attention = set(config["attn_layer_indices"] or ())
    config["layers_block_type"] = [
        "full_attention" if i in attention else "linear_attention"
        for i in range(config["num_hidden_layers"])
    ]


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters``: the legacy ``rope_scaling`` (or ``rope_parameters``)
    with ``rope_theta``, ``partial_rotary_factor`` and ``rope_type`` folded in."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _LONG_CONTEXT_ROPE:
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def _local_global_rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's ``rope_parameters`` per layer type: the global layers take ``rope_theta`` and
    any ``rope_scaling``, the local ones ``rope_local_base_freq``."""
    given = config.get("rope_parameters") or {}
    params = {
        kind: dict(given.get(kind) or {"rope_type": "default"})
        for kind in ("sliding_attention", "full_attention")
    }
    # As transformers merges them: a legacy ``type`` key does not change the ``rope_type``.
    params["full_attention"].update(config.get("rope_scaling") or {})
    params["full_attention"].setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    params["sliding_attention"].setdefault(
        "rope_theta", config.get("rope_local_base_freq", 10_000.0)
    )
    return params


def generation_eos_token_ids(folder: str | os.PathLike) -> list[int]:
    """The EOS ids of a model folder's generation_config.json (none without one)."""
    file = pathlib.Path(folder) / "generation_config.json"
    if not file.is_file():
        return []
    return as_token_ids(_read_json(file).get("eos_token_id"))


def as_token_ids(value: int | list[int] | None) -> list[int]:
    """A config's token id field (one id, a list of them, or none) as a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
