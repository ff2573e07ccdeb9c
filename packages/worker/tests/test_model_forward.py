"""The decoder's logits match transformers' for every architecture, through the paged KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember_kernels import cpu_ops
from ember_kernels.packed_linear import packable_dtypes
from ember_testing.tiny_models import tiny_w8a8_model_path
from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache
from ember_worker.layers import linear as linear_layers
from ember_worker.layers.attention import AttentionMetadata, bind_kv_cache
from ember_worker.model_loader import load_model

BLOCK_SIZE = 4


def _metadata(
    q_lens: list[int], seq_lens: list[int], blocks_per_seq: int, seqs: list[int] | None = None
) -> AttentionMetadata:
    """Row j is sequence ``seqs[j]`` (default j), which owns blocks [seqs[j] * blocks_per_seq,
    ...); its new tokens are its last q_len ones."""
    seqs = list(range(len(q_lens))) if seqs is None else seqs
    slots = []
    for seq, q_len, seq_len in zip(seqs, q_lens, seq_lens):
        first = seq * blocks_per_seq * BLOCK_SIZE
        slots += range(first + seq_len - q_len, first + seq_len)
    first_blocks = torch.tensor(seqs, dtype=torch.int32)[:, None] * blocks_per_seq
    table = first_blocks + torch.arange(blocks_per_seq, dtype=torch.int32)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=table,
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def _ember_and_hf(path, dtype=torch.float32):
    loaded = load_model(path, dtype="float32" if dtype == torch.float32 else dtype)
    c = loaded.config
    spec = KVCacheSpec(c.num_hidden_layers, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype)
    bind_kv_cache(loaded.model, allocate_kv_cache(spec, 64, torch.device("cpu")))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return loaded.model, hf


def test_prefill_then_decode_logits_match_transformers(tiny_model_any):
    model, hf = _ember_and_hf(tiny_model_any)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (n,), generator=gen) for n in (7, 19, 1)]
    with torch.no_grad():
        expected = [hf(p[None]).logits[0] for p in prompts]

    # Prefill the first len - 2 tokens of each sequence together, then two single-token decodes.
    heads = [p[: max(len(p) - 2, 1)] for p in prompts]
    meta = _metadata([len(h) for h in heads], [len(h) for h in heads], blocks_per_seq=8)
    ids = torch.cat(heads)
    positions = torch.cat([torch.arange(len(h)) for h in heads])
    logits = model.compute_logits(model(ids, positions, meta))
    for got, want in zip(logits.split([len(h) for h in heads]), expected):
        torch.testing.assert_close(got, want[: len(got)], atol=1e-4, rtol=1e-4)

    done = [len(h) for h in heads]
    for _ in range(2):
        live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        # Each live sequence keeps its own blocks.
        meta = _metadata([1] * len(live), [done[i] + 1 for i in live], 8, seqs=live)
        ids = torch.stack([prompts[i][done[i]] for i in live])
        positions = torch.tensor([done[i] for i in live])
        logits = model.compute_logits(model(ids, positions, meta))
        for row, i in enumerate(live):
            torch.testing.assert_close(logits[row], expected[i][done[i]], atol=1e-4, rtol=1e-4)
            done[i] += 1


@pytest.mark.parametrize(
    ("arch", "overrides", "windows"),
    [
        ("mistral", dict(sliding_window=5), [5, 5]),
        # Qwen2 slides only on the layers from max_window_layers on.
        ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), [None, 6]),
    ],
)
def test_sliding_window_matches_transformers(tiny_model, arch, overrides, windows):
    model, hf = _ember_and_hf(tiny_model(arch, **overrides))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == windows
    prompt = torch.arange(3, 40)
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
    meta = _metadata([len(prompt)], [len(prompt)], blocks_per_seq=16)
    logits = model.compute_logits(model(prompt, torch.arange(len(prompt)), meta))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_transformers(tiny_model, dtype):
    model, hf = _ember_and_hf(tiny_model("qwen3"), dtype)
    assert model.lm_head.weight.dtype == dtype
    prompt = torch.arange(3, 20)
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0].float()
    meta = _metadata([len(prompt)], [len(prompt)], blocks_per_seq=8)
    logits = model.compute_logits(model(prompt, torch.arange(len(prompt)), meta)).float()
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)


CPU_STACK_MODELS = [
    ("llama", {}),
    ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),  # qkv bias
    ("qwen3", {}),  # q/k norm
    ("mistral", dict(sliding_window=5)),
    (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            mlp_bias=True,
            attention_bias=True,
        ),
    ),
]


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
@pytest.mark.parametrize(
    ("dtype", "packed"),
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]
    + [(torch.bfloat16, True)] * (torch.bfloat16 in packable_dtypes())
    + [(torch.float32, "int8"), (torch.bfloat16, "int8")]
    + [(torch.float32, "w8a8"), (torch.bfloat16, "w8a8")],
)
@pytest.mark.parametrize(("arch", "overrides"), CPU_STACK_MODELS)
def test_the_compiled_cpu_stack_equals_the_per_operation_path(
    tiny_model, arch, overrides, dtype, packed, monkeypatch
):
    """Bit for bit, over a mixed step (prefills, a chunk after cached tokens, a decode) and then a
    decode of each sequence, each path on KV caches of its own, with plain weights and with
    weights packed for oneDNN, and with int8 weights (``int8_weight_only``, and a W8A8
    checkpoint's); the stack did run, on the caches bound last."""
    # the test models' are small
    monkeypatch.setitem(linear_layers.MIN_PACKED_ELEMENTS, torch.float32, 0)
    int8, w8a8 = packed == "int8", packed == "w8a8"
    write = tiny_w8a8_model_path if w8a8 else tiny_model
    loaded = load_model(
        write(arch, **overrides),
        dtype=dtype,
        pack_weights=packed is True,
        quantization="int8_weight_only" if int8 else None,
    )
    down = loaded.model.model.layers[0].mlp.down_proj.weight
    assert down.is_mkldnn == (packed is True) and (down.dtype == torch.int8) == (int8 or w8a8)
    c, model = loaded.config, loaded.model
    spec = KVCacheSpec(c.num_hidden_layers, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype)
    gen = torch.Generator().manual_seed(1)
    # Sequence 2 had 9 tokens cached by an earlier step of each run (written below).
    steps = [
        ([9], [9], [2], torch.randint(3, 2048, (9,), generator=gen)),
        ([12, 3, 1], [12, 3, 10], [0, 1, 2], torch.randint(3, 2048, (16,), generator=gen)),
        ([1, 1, 1], [13, 4, 11], [0, 1, 2], torch.randint(3, 2048, (3,), generator=gen)),
    ]
    outputs = {}
    for use_stack in (False, True):
        bind_kv_cache(model, allocate_kv_cache(spec, 64, torch.device("cpu")))
        model.model.use_cpu_stack = use_stack
        outputs[use_stack] = []
        for q_lens, seq_lens, seqs, ids in steps:
            meta = _metadata(q_lens, seq_lens, blocks_per_seq=8, seqs=seqs)
            positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
            outputs[use_stack].append(model(ids, positions, meta))
    assert model.model._cpu_stack is not None
    caches = model.model.layers[0].self_attn.attn.kv_cache
    assert model.model._cpu_stack_caches is caches
    for per_op, stacked in zip(outputs[False], outputs[True]):
        assert torch.equal(per_op, stacked)


def test_inference_enters_inference_mode_only_where_the_caller_has_not():
    from ember_worker.models.inference import inference

    seen = []

    @inference
    def probe(x):
        seen.append(torch.is_inference_mode_enabled())
        return x * 2

    out = probe(torch.ones(2))
    assert out.is_inference() and seen == [True]
    with torch.inference_mode():
        assert probe(torch.ones(2)).is_inference()
    assert seen == [True, True] and probe.__name__ == "probe"
