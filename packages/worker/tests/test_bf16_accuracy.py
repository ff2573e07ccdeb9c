"""bfloat16 accuracy by teacher forcing: at each position of reference continuations (greedy
float32 transformers), the model's argmax is compared with that reference token. Ember in
bfloat16 (packed weights, bfloat16 KV cache, the compiled kernels where they build) must agree on
at least as many positions as transformers' own bfloat16 run of the same model, less 1 point;
with int8 weight-only quantization (``quantization="int8_weight_only"``), in bfloat16 or float32
activations, within 3 points of it: on one model here (320 positions), and pooled over four
seeds of it (1,280 positions, slow) since one seed's figure moves by a point or two with the
seed. The model is chosen sensitive enough that bfloat16 rounding alone moves argmaxes.

Ember prefills each prompt, then decodes the reference continuation one token per step, as
generation runs it; transformers scores prompt and continuation in one forward.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember_testing.tiny_models import tiny_w8a8_model_path
from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache
from ember_worker.layers.attention import AttentionMetadata, bind_kv_cache
from ember_worker.model_loader import load_model

BLOCK_SIZE = 16
PROMPTS, PROMPT_LEN, CONTINUATION = 8, 12, 40
# Wide enough that bfloat16 rounding changes some argmaxes (a measurable agreement rate).
SIZES = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32)  # fmt: skip


def _metadata(q_lens: list[int], seq_lens: list[int], blocks_per_seq: int) -> AttentionMetadata:
    slots = []
    for seq, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        first = seq * blocks_per_seq * BLOCK_SIZE
        slots += range(first + seq_len - q_len, first + seq_len)
    table = torch.arange(len(q_lens) * blocks_per_seq, dtype=torch.int32).view(len(q_lens), -1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=table,
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


@functools.cache  # per model, shared by the tests here
def _references(path) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts [P, PROMPT_LEN], greedy float32 continuations [P, CONTINUATION])."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 2048, (PROMPTS, PROMPT_LEN), generator=gen)
    with torch.no_grad():
        out = hf.generate(
            prompts, max_new_tokens=CONTINUATION, min_new_tokens=CONTINUATION, do_sample=False,
            attention_mask=torch.ones_like(prompts), pad_token_id=0,
        )  # fmt: skip
    return prompts, out[:, PROMPT_LEN:]


@functools.cache
def _hf_agreement(path, dtype) -> float:
    prompts, continuations = _references(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        logits = hf(torch.cat([prompts, continuations], 1)).logits
    picks = logits[:, PROMPT_LEN - 1 : -1].argmax(-1)
    return (picks == continuations).float().mean().item()


def _ember_agreement(path, dtype, prompts, continuations, quantization=None) -> float:
    loaded = load_model(path, dtype=dtype, pack_weights=True, quantization=quantization)
    model, c = loaded.model, loaded.config
    blocks = -(-(PROMPT_LEN + CONTINUATION) // BLOCK_SIZE)
    spec = KVCacheSpec(c.num_hidden_layers, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype)
    bind_kv_cache(model, allocate_kv_cache(spec, PROMPTS * blocks, torch.device("cpu")))
    picks = []
    with torch.no_grad():
        meta = _metadata([PROMPT_LEN] * PROMPTS, [PROMPT_LEN] * PROMPTS, blocks)
        positions = torch.arange(PROMPT_LEN).repeat(PROMPTS)
        hidden = model(prompts.reshape(-1), positions, meta)
        picks.append(model.compute_logits(hidden[PROMPT_LEN - 1 :: PROMPT_LEN]).argmax(-1))
        for step in range(CONTINUATION - 1):
            length = PROMPT_LEN + step + 1
            meta = _metadata([1] * PROMPTS, [length] * PROMPTS, blocks)
            positions = torch.full((PROMPTS,), length - 1)
            hidden = model(continuations[:, step], positions, meta)
            picks.append(model.compute_logits(hidden).argmax(-1))
    return (torch.stack(picks, 1) == continuations).float().mean().item()


def test_bf16_agrees_with_fp32_as_often_as_transformers_bf16(tiny_model):
    path = tiny_model("llama", **SIZES)
    prompts, continuations = _references(path)
    assert _ember_agreement(path, torch.float32, prompts, continuations) == 1.0
    hf_bf16 = _hf_agreement(path, torch.bfloat16)
    ember_bf16 = _ember_agreement(path, torch.bfloat16, prompts, continuations)
    print(f"agreement with fp32: transformers bf16 {hf_bf16:.3f}, Ember bf16 {ember_bf16:.3f}")
    assert ember_bf16 >= hf_bf16 - 0.01


def _int8_shortfall(tiny_model, seed: int, dtype: torch.dtype) -> float:
    """Transformers bfloat16's agreement less Ember int8 weight-only's, on the model of ``seed``."""
    path = tiny_model("llama", seed=seed, **SIZES)
    prompts, continuations = _references(path)
    hf_bf16 = _hf_agreement(path, torch.bfloat16)
    int8 = _ember_agreement(path, dtype, prompts, continuations, "int8_weight_only")
    print(f"seed {seed}: transformers bf16 {hf_bf16:.3f}, Ember int8 {dtype} {int8:.3f}")
    return hf_bf16 - int8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_weight_only_agrees_within_3_points_of_transformers_bf16(tiny_model, dtype):
    assert _int8_shortfall(tiny_model, 0, dtype) <= 0.03


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_weight_only_within_3_points_pooled_over_seeds(tiny_model, dtype):
    shortfalls = [_int8_shortfall(tiny_model, seed, dtype) for seed in range(4)]
    assert sum(shortfalls) / len(shortfalls) <= 0.03


def test_w8a8_checkpoint_agreement_stays_where_measured(tiny_model):
    """A W8A8 checkpoint of the same model (int8 activations per token besides int8 weights):
    the issue sets no target; on this sensitive model it measured 8-10 points below transformers'
    bfloat16 (85-87% against 95%), and this guards that level (12 points)."""
    path = tiny_model("llama", **SIZES)
    prompts, continuations = _references(path)
    hf_bf16 = _hf_agreement(path, torch.bfloat16)
    w8a8_path = tiny_w8a8_model_path("llama", **SIZES)
    for dtype in (torch.bfloat16, torch.float32):
        w8a8 = _ember_agreement(w8a8_path, dtype, prompts, continuations)
        print(
            f"agreement with fp32: transformers bf16 {hf_bf16:.3f}, Ember W8A8 {dtype} {w8a8:.3f}"
        )
        assert w8a8 >= hf_bf16 - 0.12
