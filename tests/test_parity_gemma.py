"""Gemma 2 and Gemma 3 (text) against transformers, greedy tokens equal in float32.

Tiny random checkpoints interleave local layers (a window of 16 tokens, shorter than most
prompts) and global layers; Gemma 2's soft-capping of scores and logits, Gemma 3's q/k norm and
local RoPE base, the query pre-scaling, sandwich norms and scaled embeddings all change the
tokens. Whole and chunked prefill, preemption, prefix-cache hits, all in mixed batches.
"""

from __future__ import annotations

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

from ember_kv_cache import HybridKVCacheManager
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_testing.tiny_models import HYBRID_ARCHITECTURES, tiny_model_path
from ember_worker.executor import InProcessExecutor
from ember_worker.hf_config import load_hf_config
from ember_worker.models.config import DecoderConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The tiny models' 4 layers form two groups (local: 0, 2; global: 1, 3) whose layer j shares
# cache tensor j: a block spans 2 layers. 2 KV heads of 16, float32, keys and values.
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


def make_engine(
    arch: str, *, num_blocks: int = 512, max_num_batched_tokens: int = 512, prefix_caching=False
) -> EngineCore:
    executor = InProcessExecutor(
        tiny_model_path(arch),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * BYTES_PER_BLOCK,
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


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_config_reads_the_interleaved_layers_and_gemma_settings(arch):
    config = DecoderConfig.from_hf_config(load_hf_config(tiny_model_path(arch)))
    assert config.sliding_windows == (16, None, 16, None)
    assert config.query_pre_attn_scalar == 24.0
    if arch == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (3.0, 4.0)
    else:
        assert config.qk_norm and config.local_rope_theta == 500.0 and config.rope_theta == 1e4


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_greedy_parity_whole_and_chunked_prefill(arch):
    assert sum(len(p) > 16 for p in parity_prompts()) >= 8  # past the local window
    for budget in (512, 24):
        outputs, totals = run(
            make_engine(arch, max_num_batched_tokens=budget), parity_prompts(), greedy
        )
        assert totals["max_running"] > 1
        assert_matches_hf(arch, outputs)


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_greedy_parity_under_preemption(arch):
    outputs, totals = run(make_engine(arch, num_blocks=40), parity_prompts(), greedy)
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_greedy_parity_with_prefix_caching(arch):
    core = make_engine(arch, prefix_caching=True)
    first, _ = run(core, parity_prompts(), greedy, prefix="first-")
    second, totals = run(core, parity_prompts(), greedy, prefix="second-")
    assert totals["prefix_cache_hits"] > 0
    assert_matches_hf(arch, first)
    assert_matches_hf(arch, second)


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_local_layers_hold_only_their_window(arch):
    core = make_engine(arch)
    prompt = parity_prompts()[-1]  # 110 tokens
    core.add_request(EngineCoreRequest("long", prompt, greedy(0), eos_token_id=2))
    tokens = []
    while len(tokens) < 40:
        tokens += [t for out in core.step().outputs for t in out.new_token_ids]
    local, full = (group.get_block_ids("long") for group in core.kv_cache_manager.groups)
    assert len(full) == len(local) and 0 not in full
    # A window of 16 tokens: the next query sees 15 before it, in at most 2 blocks.
    assert sum(1 for block in local if block) <= 2
    assert len(prompt) + len(tokens) > 9 * BLOCK_SIZE
    while core.has_unfinished_requests():
        tokens += [t for out in core.step().outputs for t in out.new_token_ids]
    assert tuple(tokens) == hf_greedy(arch)[-1]
