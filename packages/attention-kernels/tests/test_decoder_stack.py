"""The compiled decoder stack against the same layers composed of the per-operation functions."""

from __future__ import annotations

import time

import pytest
import torch
from ek_inputs import fresh_generator

from ember_kernels import RotaryEmbedding, cpu_ops
from ember_kernels import lora as lora_module
from ember_kernels.lora import LoRAMapping, lora_expand, lora_shrink
from ember_kernels.packed_linear import linear, pack_linear_weight, packable_dtypes

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")

HIDDEN, HEADS, KV_HEADS, HEAD_SIZE, INTERMEDIATE, BLOCK = 96, 6, 2, 16, 160, 4
EPS = 1e-5


def random_layer(gen, dtype, bias: bool, qk_norm: bool, window: int) -> dict:
    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.2).to(dtype)

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    return dict(
        input_norm=w(HIDDEN) + 1,
        qkv=w(HIDDEN, qkv).t(),  # [out, in] stored input-major, as the worker keeps them
        qkv_bias=w(qkv) if bias else None,
        q_norm=w(HEAD_SIZE) + 1 if qk_norm else None,
        k_norm=w(HEAD_SIZE) + 1 if qk_norm else None,
        o_proj=w(HIDDEN, HEADS * HEAD_SIZE),
        o_bias=w(HIDDEN) if bias else None,
        post_norm=w(HIDDEN) + 1,
        gate_up=w(2 * INTERMEDIATE, HIDDEN),
        gate_up_bias=w(2 * INTERMEDIATE) if bias else None,
        down=w(HIDDEN, INTERMEDIATE),
        down_bias=w(HIDDEN) if bias else None,
        window=window,
    )


WEIGHTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_norm",
           "gate_up", "gate_up_bias", "down", "down_bias")  # fmt: skip


def weights_in_order(layer: dict) -> list:
    """A layer's weights in ``add_layer``'s order (before the caches and the window)."""
    return [layer[name] for name in WEIGHTS]


def add_lora(x, y, lora, mapping):
    """``y`` plus each row's adapter delta (``lora = (a, [b, ...])``) as the worker's LoRA
    layers add it (``ember_kernels.lora``: per-row kernels or one matmul per adapter); ``y``
    alone without a mapping."""
    if lora is None or mapping is None:
        return y
    a, bs = lora
    h = lora_shrink(x, a, mapping)
    offset = 0
    for i, b in enumerate(bs):
        lora_expand(y, h, b, mapping, y_offset=offset, h_offset=i * b.shape[2])
        offset += b.shape[1]
    return y


def per_operation(x, residual, layer, caches, rotary, meta, lora_mapping=None):
    """One layer from ``cpu_ops``' single functions and ``packed_linear.linear``, as a model
    would."""
    tokens = x.shape[0]
    lora = layer.get("lora", [None] * 4)
    if residual is None:
        residual, x = x, cpu_ops.rms_norm(x, layer["input_norm"], EPS)
    else:
        x, residual = cpu_ops.fused_add_rms_norm(x, residual, layer["input_norm"], EPS)
    qkv = add_lora(x, linear(x, layer["qkv"], layer["qkv_bias"]), lora[0], lora_mapping)
    q, k, v = qkv.split([HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE], dim=-1)
    q, k = q.reshape(tokens, HEADS, HEAD_SIZE), k.reshape(tokens, KV_HEADS, HEAD_SIZE)
    v = v.reshape(tokens, KV_HEADS, HEAD_SIZE)
    if layer["q_norm"] is not None:
        q = cpu_ops.rms_norm(q, layer["q_norm"], EPS)
        k = cpu_ops.rms_norm(k, layer["k_norm"], EPS)
    q, k = rotary(meta["positions"], q, k)
    cpu_ops.reshape_and_cache(k, v, *caches, meta["slot_mapping"])
    out = cpu_ops.paged_attention(
        q,
        *caches,
        meta["block_table"],
        meta["query_start_loc"],
        meta["seq_lens"],
        scale=HEAD_SIZE**-0.5,
        sliding_window=layer["window"] or None,
    )
    attended = out.view(tokens, -1)
    x = add_lora(attended, linear(attended, layer["o_proj"]), lora[1], lora_mapping)
    x = x if layer["o_bias"] is None else x + layer["o_bias"]
    x, residual = cpu_ops.fused_add_rms_norm(x, residual, layer["post_norm"], EPS)
    gate_up = add_lora(x, linear(x, layer["gate_up"], layer["gate_up_bias"]), lora[2], lora_mapping)
    act = cpu_ops.silu_and_mul(gate_up)
    x = add_lora(act, linear(act, layer["down"]), lora[3], lora_mapping)
    return (x if layer["down_bias"] is None else x + layer["down_bias"]), residual


def step(q_lens, seq_lens, tables):
    """Metadata of one step: sequence i's new tokens are its last q_lens[i] of seq_lens[i]."""
    slots, positions = [], []
    for table, q, s in zip(tables, q_lens, seq_lens):
        pos = torch.arange(s - q, s)
        positions.append(pos)
        slots.append(table[pos // BLOCK].long() * BLOCK + pos % BLOCK)
    return dict(
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        block_table=torch.stack(tables),
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    ("dtype", "packed"),
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
     (torch.float16, False)] + [(torch.bfloat16, True)] * (torch.bfloat16 in packable_dtypes()),
)  # fmt: skip
@pytest.mark.parametrize(
    ("bias", "qk_norm", "windows"),
    [(False, False, [0, 0]), (True, False, [0, 5]), (False, True, [7, 7])],
)
def test_stack_equals_the_per_operation_layers(dtype, packed, bias, qk_norm, windows):
    """Bit for bit, with plain weights and with weights packed for oneDNN."""
    gen, seed = fresh_generator()
    layers = [random_layer(gen, dtype, bias, qk_norm, w) for w in windows]
    if packed:
        for layer in layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                layer[name] = pack_linear_weight(layer[name])
    assert_stack_equals_per_operation(layers, dtype, seed)


def assert_stack_equals_per_operation(layers, dtype, seed, num_slots=0, timed=False):
    """Three steps (prefills, one chunked after cached tokens, then a decode of every
    sequence) through the stack and through the per-operation layers: equal outputs and caches.
    With ``num_slots``, every token gets a random LoRA slot (or -1) as well: the prefills have
    many tokens per adapter (one matmul per adapter), the decode a few (per-row kernels).
    ``timed``: the stack sums its phases' seconds; returns (stack, seconds in its forwards)."""
    rotary = RotaryEmbedding(HEAD_SIZE, HEAD_SIZE, 64, 10000.0, True, None, dtype)
    num_blocks = 24
    runs = {}
    for name in ("per_operation", "stack"):
        caches = [
            tuple(torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, dtype=dtype) for _ in "kv")
            for _ in layers
        ]
        stack = cpu_ops.decoder_stack(
            HEADS, KV_HEADS, HEAD_SIZE, EPS, HEAD_SIZE**-0.5, rotary.cos_sin_cache, True
        )
        for layer, (key_cache, value_cache) in zip(layers, caches):
            stack.add_layer(*weights_in_order(layer), key_cache, value_cache, layer["window"])
            for projection, lora in enumerate(layer.get("lora", ())):
                stack.set_lora(projection, *lora)
        stack.set_timed(timed)
        forward_seconds = 0.0
        step_gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(num_blocks, generator=step_gen).to(torch.int32)
        tables = [order[:6], order[6:12], order[12:18]]
        outputs = []
        for q_lens, seq_lens in (
            ([9, 3], [9, 3]),
            ([11, 2, 1], [11, 5, 10]),
            ([1] * 3, [12, 6, 11]),
        ):
            meta = step(q_lens, seq_lens, tables[: len(q_lens)])
            x = torch.randn(sum(q_lens), HIDDEN, generator=step_gen).to(dtype)
            mapping, lora_args = None, {}
            if num_slots:
                tokens = sum(q_lens)
                slots = torch.randint(-1, num_slots, (tokens,), generator=step_gen)
                if tokens > 8:  # a prefill of one adapter: every token, or all but a few
                    slots[:] = num_slots - 1
                    if len(q_lens) > 2:
                        slots[::4] = -1
                mapping = LoRAMapping(slots, num_slots)
                grouped = not mapping.runs_compiled(x)
                assert grouped == (tokens > 8)
                lora_args = dict(lora_slots=slots, lora_grouped=grouped)
            if name == "stack":
                args = [meta[k] for k in ("positions", "slot_mapping", "block_table")]
                args += [meta["query_start_loc"], meta["seq_lens"]]
                start = time.perf_counter()
                out = stack.forward(x, None, *args, **lora_args)
                forward_seconds += time.perf_counter() - start
            else:
                out, residual = x, None
                for layer, layer_caches in zip(layers, caches):
                    out, residual = per_operation(
                        out, residual, layer, layer_caches, rotary, meta, mapping
                    )
                out = (out, residual)
            outputs.append(out)
        runs[name] = (outputs, caches)
    for (a, ra), (b, rb) in zip(*(runs[n][0] for n in runs)):
        assert torch.equal(a, b) and torch.equal(ra, rb), f"seed {seed}"
    for per_op, stacked in zip(*(runs[n][1] for n in runs)):
        assert all(torch.equal(x, y) for x, y in zip(per_op, stacked)), f"seed {seed}: caches"
    return stack, forward_seconds


@pytest.mark.parametrize("dtype", packable_dtypes())
def test_timed_stack_sums_each_phase_within_its_forwards(dtype):
    """Timing changes no number, and the phases' sums (every one of them run) fit inside the
    forwards' own wall-clock time; turning timing on again starts from zero."""
    gen, seed = fresh_generator()
    layers = [random_layer(gen, dtype, True, True, w) for w in (0, 5)]
    for layer in layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            layer[name] = pack_linear_weight(layer[name])
    stack, forward_seconds = assert_stack_equals_per_operation(layers, dtype, seed, timed=True)
    phases = dict(stack.phase_seconds())
    assert list(phases) == ["norms", "qkv", "qk_norm_rope_cache", "attention", "o_proj",
                            "gate_up", "silu_and_mul", "down"]  # fmt: skip
    assert all(seconds > 0 for seconds in phases.values())
    assert sum(phases.values()) <= forward_seconds
    stack.set_timed(True)
    assert all(seconds == 0 for _, seconds in stack.phase_seconds())


def random_lora(gen, dtype, num_slots, rank):
    """LoRA slots on every projection, B in the worker's layout (a transposed [slots, rank,
    out]), some slots' adapters of a smaller rank (zero padding)."""

    def pair(k, outs):
        a = torch.randn(num_slots, len(outs) * rank, k, generator=gen) * 0.2
        bs = [torch.randn(num_slots, rank, n, generator=gen) * 0.2 for n in outs]
        a[0, rank // 2 :] = 0  # slot 0 holds a smaller rank
        return a.to(dtype), [b.to(dtype).transpose(1, 2) for b in bs]

    q, kv = HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE
    return [
        pair(HIDDEN, (q, kv, kv)),
        pair(q, (HIDDEN,)),
        pair(HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
        pair(INTERMEDIATE, (HIDDEN,)),
    ]


@pytest.mark.parametrize(
    ("dtype", "packed"), [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]
)
def test_stack_with_lora_slots_equals_the_per_operation_layers(dtype, packed, monkeypatch):
    """Bit for bit: each token's adapter added after its projection's matmul (before a
    row-parallel bias), tokens of several adapters and none in every step."""
    # The prefills here are short: a lower limit makes them run one matmul per adapter.
    monkeypatch.setattr(lora_module, "COMPILED_MAX_ROWS_PER_ADAPTER", 8)
    gen, seed = fresh_generator()
    layers = [random_layer(gen, dtype, True, False, w) for w in (0, 5)]
    for layer in layers:
        layer["lora"] = random_lora(gen, dtype, num_slots=3, rank=4)
        if packed:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                layer[name] = pack_linear_weight(layer[name])
    assert_stack_equals_per_operation(layers, dtype, seed, num_slots=3)


def test_bad_shapes_raise_value_error_naming_the_field():
    stack = cpu_ops.decoder_stack(HEADS, KV_HEADS, HEAD_SIZE, EPS, 0.25, torch.zeros(64, 16), True)
    layer = random_layer(torch.Generator().manual_seed(0), torch.float32, False, False, 0)
    caches = [torch.zeros(4, BLOCK, KV_HEADS, HEAD_SIZE) for _ in "kv"]
    args = weights_in_order(layer)
    with pytest.raises(ValueError, match="qkv"):
        stack.add_layer(*args[:1], args[1][:-1], *args[2:], *caches, 0)
    with pytest.raises(ValueError, match="key_cache"):
        stack.add_layer(*args, torch.zeros(4, BLOCK, 3, HEAD_SIZE), caches[1], 0)
    with pytest.raises(ValueError, match="num_heads"):
        cpu_ops.decoder_stack(5, 2, HEAD_SIZE, EPS, 0.25, torch.zeros(64, 16), True)
    stack.add_layer(*args, *caches, 0)
    a, bs = random_lora(torch.Generator().manual_seed(0), torch.float32, 2, 4)[0]
    with pytest.raises(ValueError, match="projection"):
        stack.set_lora(4, a, bs)
    with pytest.raises(ValueError, match="lora_a"):
        stack.set_lora(0, a, bs[:2])
    with pytest.raises(ValueError, match="lora_b"):
        stack.set_lora(0, a, [b[:1] for b in bs])
