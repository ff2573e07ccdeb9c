"""The tiny-model factory writes real HF folders that transformers loads offline."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ember_testing.tiny_models import ARCHITECTURES, tiny_model_path


def _weights(path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_round_trip_through_transformers(arch, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_model_path(arch)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == arch
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.dtype == torch.float32
    assert len(tokenizer) <= config.vocab_size

    text = "def parse(text): return 'Grüße 日本語 🙂'"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size)
    assert torch.isfinite(logits).all()
    # The saved weights are exactly what the loaded model holds.
    state = model.state_dict()
    for name, tensor in _weights(path).items():
        assert torch.equal(state[name], tensor), name


def test_architecture_features_are_present():
    qwen2 = _weights(tiny_model_path("qwen2"))
    assert any(name.endswith("q_proj.bias") for name in qwen2)
    assert "lm_head.weight" not in qwen2  # tied embeddings
    qwen3 = _weights(tiny_model_path("qwen3"))
    assert any(name.endswith("self_attn.q_norm.weight") for name in qwen3)
    llama = json.loads((tiny_model_path("llama") / "config.json").read_text())
    # transformers 5 writes `rope_parameters`; older checkpoints carry `rope_scaling`.
    rope = llama.get("rope_parameters") or llama["rope_scaling"]
    assert rope["rope_type"] == "llama3"
    assert "lm_head.weight" in _weights(tiny_model_path("llama"))


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_TINY_MODELS_DIR", str(tmp_path / "a"))
    first = _weights(tiny_model_path("qwen3", seed=7))
    monkeypatch.setenv("EMBER_TINY_MODELS_DIR", str(tmp_path / "b"))
    second = _weights(tiny_model_path("qwen3", seed=7))
    other = _weights(tiny_model_path("qwen3", seed=8))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].ndim == 2)


def test_sharded_checkpoint_has_an_index(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_TINY_MODELS_DIR", str(tmp_path))
    path = tiny_model_path("llama", max_shard_size="200KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_weights(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == "llama"


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="arch must be one of"):
        tiny_model_path("gpt2")
