"""Config files read without transformers, held to transformers' own reading of them.

Every field Ember reads from a model's config (through ``DecoderConfig``, ``resolve_dtype`` and
the server's ``ModelConfig``) must come out as ``AutoConfig`` reads it, for each supported model
type, over config.json variants that leave out, null or set each field, in the legacy and the
current RoPE forms, with windows, labels and dtypes."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoConfig

from ember_worker.hf_config import (
    MODEL_TYPE_DEFAULTS,
    generation_eos_token_ids,
    hf_config_from_dict,
    load_hf_config,
)
from ember_worker.model_loader import resolve_dtype
from ember_worker.models import DecoderConfig

# Fields the server's ModelConfig reads, beside DecoderConfig's.
SERVER_FIELDS = (
    "max_position_embeddings", "vocab_size", "hidden_size", "bos_token_id", "eos_token_id",
    "num_labels", "id2label", "architectures",
)  # fmt: skip
ARCHITECTURES = {
    "llama": ["LlamaForCausalLM", "LlamaForSequenceClassification"],
    "mistral": ["MistralForCausalLM"],
    "qwen2": ["Qwen2ForCausalLM", "Qwen2ForSequenceClassification"],
    "qwen3": ["Qwen3ForCausalLM", "Qwen3ForSequenceClassification"],
    "gemma2": ["Gemma2ForCausalLM"],
    "gemma3_text": ["Gemma3ForCausalLM"],
    "mixtral": ["MixtralForCausalLM"],
    "qwen2_moe": ["Qwen2MoeForCausalLM"],
    "qwen3_moe": ["Qwen3MoeForCausalLM"],
    "deepseek_v2": ["DeepseekV2ForCausalLM"],
    "deepseek_v3": ["DeepseekV3ForCausalLM"],
    "bamba": ["BambaForCausalLM"],
}
# Fields a transformers class types as a plain int: it refuses the config when they are null.
NULL_REFUSED = {
    "mistral": ("num_key_value_heads",),
    "qwen3": ("head_dim",),
    "gemma2": ("num_key_value_heads", "head_dim"),
    "gemma3_text": ("num_key_value_heads", "head_dim"),
    "mixtral": ("num_key_value_heads",),
    "qwen3_moe": ("num_key_value_heads",),
}
ABSENT = object()
ROPES = [
    {},
    {"rope_theta": 500000.0},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e6},
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 20000.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0},
     "original_max_position_embeddings": 128},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    {"partial_rotary_factor": 0.5},
]  # fmt: skip
CHOICES = {
    "hidden_size": [ABSENT, 128],
    "num_attention_heads": [ABSENT, 4],
    "num_key_value_heads": [ABSENT, None, 1, 2],
    "head_dim": [ABSENT, None, 16, 64],
    "intermediate_size": [ABSENT, 96],
    "num_hidden_layers": [ABSENT, 3],
    "vocab_size": [ABSENT, 512],
    "max_position_embeddings": [ABSENT, 4096],
    "rms_norm_eps": [ABSENT, 1e-5],
    "tie_word_embeddings": [ABSENT, True, False],
    "attention_bias": [ABSENT, True, False],
    "mlp_bias": [ABSENT, True],
    "sliding_window": [ABSENT, None, 64],
    "use_sliding_window": [ABSENT, True, False],
    "max_window_layers": [ABSENT, 1],
    "bos_token_id": [ABSENT, None, 7],
    "eos_token_id": [ABSENT, None, 3, [3, 9]],
    "id2label": [ABSENT, {"0": "no", "1": "yes", "2": "maybe"}],
    "num_labels": [ABSENT, 1, 3],
    "dtype": [ABSENT, "bfloat16", "float32"],
    "torch_dtype": [ABSENT, "float16"],
}

# Mixture-of-experts fields, and the model types that refuse sliding windows (left out for them).
MOE_CHOICES = {
    "num_experts": [ABSENT, 4],
    "num_local_experts": [ABSENT, 6],
    "num_experts_per_tok": [ABSENT, 1, 3],
    "moe_intermediate_size": [ABSENT, 48],
    "shared_expert_intermediate_size": [ABSENT, 80],
    "norm_topk_prob": [ABSENT, True, False],
    "decoder_sparse_step": [ABSENT, 2],
    "mlp_only_layers": [ABSENT, [0]],
}
DEEPSEEK_CHOICES = {
    "n_routed_experts": [ABSENT, 8],
    "num_experts_per_tok": [ABSENT, 2],
    "n_group": [ABSENT, 4],
    "topk_group": [ABSENT, 2],
    "n_shared_experts": [ABSENT, 1, 2],
    "first_k_dense_replace": [ABSENT, 1],
    "q_lora_rank": [ABSENT, None, 32],
    "kv_lora_rank": [ABSENT, 48],
    "qk_rope_head_dim": [ABSENT, 16],
    "qk_nope_head_dim": [ABSENT, 32],
    "v_head_dim": [ABSENT, 24],
    "routed_scaling_factor": [ABSENT, 2.5],
    "norm_topk_prob": [ABSENT, True, False],
    "topk_method": [ABSENT, "greedy", "group_limited_greedy"],
    "rope_interleave": [ABSENT, False],
}
# Bamba's Mamba-2 mixers (its head size is derived: mamba_expand * hidden_size / mamba_n_heads).
BAMBA_CHOICES = {
    "attn_layer_indices": [ABSENT, None, [1], [0, 2]],
    "mamba_n_heads": [ABSENT, 8, 16],
    "mamba_n_groups": [ABSENT, 2],
    "mamba_d_state": [ABSENT, 16],
    "mamba_d_conv": [ABSENT, 3],
    "mamba_chunk_size": [ABSENT, 64],
    "mamba_conv_bias": [ABSENT, False],
    "mamba_proj_bias": [ABSENT, True],
    "time_step_limit": [ABSENT, [0.001, 100.0]],
}
WINDOW_FIELDS = ("sliding_window", "use_sliding_window", "max_window_layers")


def _variants(model_type: str, count: int) -> list[dict]:
    """The bare config (every default), then ``count`` random ones."""
    rng = random.Random(f"hf-config-{model_type}")
    variants = [{"model_type": model_type, "architectures": ARCHITECTURES[model_type][:1]}]
    for _ in range(count):
        raw = {"model_type": model_type, "architectures": [rng.choice(ARCHITECTURES[model_type])]}
        deepseek = model_type.startswith("deepseek")
        moe = deepseek or model_type in ("mixtral", "qwen2_moe", "qwen3_moe")
        bamba = model_type == "bamba"
        extra = DEEPSEEK_CHOICES if deepseek else MOE_CHOICES if moe else {}
        extra = BAMBA_CHOICES if bamba else extra
        for field, values in {**CHOICES, **extra}.items():
            value = rng.choice(values)
            # DeepSeek's head_dim is its rotary part (qk_rope_head_dim), never set on its own.
            skip = ((moe or bamba) and field in WINDOW_FIELDS) or (deepseek and field == "head_dim")
            if value is not ABSENT and not skip:
                raw[field] = value
        if moe and "num_experts" in raw and "num_local_experts" in raw:
            del raw["num_local_experts"]  # one name per config.json
        if "num_attention_heads" not in raw and "hidden_size" in raw:
            raw["num_attention_heads"] = 4  # the default 32 heads do not divide 128
        for field in NULL_REFUSED.get(model_type, ()):
            if field in raw and raw[field] is None:
                del raw[field]
        if "id2label" in raw and "num_labels" in raw:
            del raw["num_labels"]  # transformers only warns when they disagree
        if rng.random() < 0.3 and raw.get("num_hidden_layers") == 3 and not (moe or bamba):
            raw["layer_types"] = ["full_attention", "sliding_attention", "full_attention"]
        raw.update(json.loads(json.dumps(rng.choice(ROPES))))
        variants.append(raw)
    return variants


def _fields(config) -> dict:
    fields = {name: getattr(config, name, None) for name in SERVER_FIELDS}
    fields["decoder"] = DecoderConfig.from_hf_config(config)
    fields["dtype"] = resolve_dtype("auto", config)
    return fields


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPE_DEFAULTS))
def test_every_field_reads_as_transformers_reads_it(tmp_path, model_type):
    for index, raw in enumerate(_variants(model_type, 60)):
        folder = tmp_path / str(index)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(raw))
        expected = _fields(AutoConfig.from_pretrained(folder))
        assert _fields(load_hf_config(folder)) == expected, raw


def test_the_defaults_are_the_transformers_classes_defaults():
    for model_type in MODEL_TYPE_DEFAULTS:
        raw = {"model_type": model_type}
        ours, theirs = hf_config_from_dict(raw), AutoConfig.for_model(model_type)
        for field in MODEL_TYPE_DEFAULTS[model_type]:
            assert getattr(ours, field) == getattr(theirs, field), (model_type, field)


def test_generation_config_eos_ids(tmp_path):
    assert generation_eos_token_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 6]}')
    assert generation_eos_token_ids(tmp_path) == [5, 6]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 4}')
    assert generation_eos_token_ids(tmp_path) == [4]


def test_bad_folders_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds list, not a JSON object"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LM"]}')
    with pytest.raises(ValueError, match=r"model type 'gpt2' \(architectures \['GPT2LM'\]\) is"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("config_only", [False, True])
def test_the_api_server_asks_the_hub_for_the_json_files_alone(tmp_path, monkeypatch, config_only):
    """The engine fetches the weights; the API server reading the config must not fetch them."""
    import huggingface_hub

    from ember_worker.hf_config import resolve_model_path

    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        asked.append(allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model_path("some-org/some-model", config_only=config_only) == tmp_path
    (patterns,) = asked
    if config_only:
        assert patterns and all(p.endswith(".json") for p in patterns)
    else:
        assert "*.safetensors" in patterns
