"""An attention / Mamba-2 hybrid (Bamba) against transformers, greedy tokens equal in float32.

The tiny random checkpoint has three Mamba-2 mixers and one attention layer; transformers runs
its pure-torch Mamba path (checked: neither mamba_ssm nor causal_conv1d is installed). Each
request's conv window and SSM state live in its state block, carried across chunks: whole and
chunked prefill in mixed batches of prefill and decode, and preemption (the state rebuilt by
recomputing from the prompt). Prefix caching is off for this model, said once in the log.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
from test_parity import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_PROMPTS,
    assert_matches_hf,
    greedy,
    hf_greedy,
    parity_prompts,
    run,
)

from ember_kv_cache import FullAttentionSpec, HybridKVCacheManager, StateSpec
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_testing.tiny_models import tiny_model_path
from ember_worker.executor import InProcessExecutor
from ember_worker.hf_config import load_hf_config
from ember_worker.mamba_state import MambaStateSpec
from ember_worker.models.config import DecoderConfig
from ember_worker.models.mamba_mixer import MambaStepMetadata

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "bamba"
# One attention layer: 2 KV heads of 16, keys and values, float32. Three mixers: a conv window of
# 3 x (128 + 2 * 2 * 16) channels and an SSM state of 8 heads x 16 x 16, float32, per request.
KV_BYTES_PER_BLOCK = 2 * BLOCK_SIZE * 2 * 16 * 4
STATE_BYTES_PER_REQUEST = 3 * (3 * 192 + 8 * 16 * 16) * 4


def make_engine(
    *, num_blocks: int = 256, max_num_batched_tokens: int = 512, prefix_caching=False
) -> EngineCore:
    executor = InProcessExecutor(
        tiny_model_path(ARCH),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * KV_BYTES_PER_BLOCK + NUM_PROMPTS * STATE_BYTES_PER_REQUEST,
        seed=0,
    )
    assert executor.num_kv_blocks == num_blocks
    config = SchedulerConfig(
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=prefix_caching,
    )
    core = EngineCore(executor, config, executor.grammar_compiler)
    assert isinstance(core.kv_cache_manager, HybridKVCacheManager)
    return core


def test_transformers_runs_its_torch_mamba_path():
    assert importlib.util.find_spec("mamba_ssm") is None
    assert importlib.util.find_spec("causal_conv1d") is None


def test_config_and_specs_read_the_mixers_and_the_attention_layer():
    config = DecoderConfig.from_hf_config(load_hf_config(tiny_model_path(ARCH)))
    assert config.mamba_layers == (True, False, True, True)
    assert (config.mamba_heads, config.mamba_head_dim, config.mamba_groups) == (8, 16, 2)
    assert config.rotary_dim == config.head_dim // 2
    executor = make_engine().executor
    assert executor.kv_cache_specs == [StateSpec(), FullAttentionSpec(), StateSpec(), StateSpec()]
    spec = MambaStateSpec.for_model(executor.loaded.model)
    assert spec.bytes_per_request == STATE_BYTES_PER_REQUEST
    # The states of max_num_seqs requests come first out of kv_cache_memory.
    with pytest.raises(ValueError, match=r"kv_cache_memory .* Mamba states of max_num_seqs=16"):
        executor.worker.model_runner.num_kv_blocks_for(NUM_PROMPTS * STATE_BYTES_PER_REQUEST)


def test_greedy_parity_whole_and_chunked_prefill_in_mixed_batches(monkeypatch):
    assert max(len(p) for p in parity_prompts()) > 4 * 16  # several scan chunks
    steps = []  # per step: (rows decoding one token, rows running a prefill chunk)
    build = MambaStepMetadata.build

    def recording_build(metadata):
        step = build(metadata)
        count = lambda rows: 0 if rows is None else rows.numel()  # noqa: E731
        steps.append((count(step.decode_rows), count(step.prefill_rows)))
        return step

    monkeypatch.setattr(MambaStepMetadata, "build", staticmethod(recording_build))
    for budget in (512, 24):
        steps.clear()
        outputs, totals = run(make_engine(max_num_batched_tokens=budget), parity_prompts(), greedy)
        assert totals["max_running"] > 1
        assert any(decoding and prefilling for decoding, prefilling in steps)  # mixed steps
        assert_matches_hf(ARCH, outputs)


def test_greedy_parity_under_preemption():
    outputs, totals = run(make_engine(num_blocks=40), parity_prompts(), greedy)
    assert totals["num_preemptions"] > 0
    assert_matches_hf(ARCH, outputs)


def test_prefix_caching_is_off_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="ember_kv_cache.hybrid_manager"):
        core = make_engine(prefix_caching=True)
    notes = [r for r in caplog.records if "prefix caching is off" in r.message]
    assert len(notes) == 1 and not core.kv_cache_manager.enable_caching
    first, _ = run(core, parity_prompts(), greedy, prefix="first-")
    second, totals = run(core, parity_prompts(), greedy, prefix="second-")
    assert totals["prefix_cache_hits"] == 0
    assert_matches_hf(ARCH, first)
    assert_matches_hf(ARCH, second)


def test_a_request_holds_one_state_block_beside_its_kv_blocks():
    core = make_engine()
    prompt = parity_prompts()[-1]
    core.add_request(EngineCoreRequest("long", prompt, greedy(0), eos_token_id=2))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step().outputs for t in out.new_token_ids]
        if len(tokens) == 10:
            groups = core.kv_cache_manager.groups
            state, full = (g.get_block_ids("long") for g in groups)
            assert len(state) == 1 and len(full) == -(-(len(prompt) + 10) // BLOCK_SIZE)
    assert tuple(tokens) == hf_greedy(ARCH)[-1]


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
        ("enable_lora", True),
    ],
)
def test_what_a_mamba_hybrid_cannot_do_is_refused_by_name(setting, value):
    from ember import LLM

    field = "speculative_config" if setting == "speculative_config" else "lora_config"
    with pytest.raises(ValueError, match=f"{field}: .*Mamba hybrid"):
        LLM(
            str(tiny_model_path(ARCH)),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory=64 * (KV_BYTES_PER_BLOCK + STATE_BYTES_PER_REQUEST),
            **{setting: value},
        )
