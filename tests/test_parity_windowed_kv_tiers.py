"""Sliding-window and interleaved local/global models served from a CPU KV tier, token for token
equal to transformers in float32.

The local prefix cache is reset between the runs, so the second run's hits come from the tier: each KV group's
chunks are saved by its own block table (a local group's earlier blocks may have left its window
already) and a hit needs only the local layers' window tail. A fresh engine also loads from a
disk tier another engine filled (the keys and the layout fingerprint carry the groups).
"""

from __future__ import annotations

import pytest
import test_parity_sliding_window as windowed
from test_parity import BLOCK_SIZE, MAX_MODEL_LEN, NUM_PROMPTS, assert_matches_hf, parity_prompts
from test_parity import greedy as parity_greedy
from test_parity import run as run_to_completion
from test_parity_gemma import BYTES_PER_BLOCK
from test_parity_mamba_hybrid import KV_BYTES_PER_BLOCK, STATE_BYTES_PER_REQUEST

from ember_kv_cache import HybridKVCacheManager, KVTransferConfig, LocalAttentionManager
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_spec_decode import SpeculativeConfig
from ember_testing.tiny_models import HYBRID_ARCHITECTURES, tiny_model_path
from ember_worker.executor import InProcessExecutor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 2 * BLOCK_SIZE


CPU_TIER = {"type": "cpu", "max_bytes": 1 << 28}


def transfer_config(tier: dict) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "TieredConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": [tier]},
        }
    )


def make_engine(
    path,
    *,
    num_blocks: int,
    bytes_per_block: int,
    budget: int,
    max_num_seqs: int,
    max_model_len: int,
    tier: dict = CPU_TIER,
):
    config = transfer_config(tier)
    executor = InProcessExecutor(
        path,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * bytes_per_block,
        seed=0,
        kv_transfer_config=config,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=True,  # the connector looks up past the local hit
    )
    return EngineCore(executor, scheduler, executor.grammar_compiler, kv_transfer_config=config)


def run(core: EngineCore, prompts, params_of, prefix: str, tier="cpu") -> tuple[dict, int, int]:
    """``run_to_completion``, also counting the ``tier``'s hits and the tokens loaded."""
    counts = {"hits": 0, "loaded": 0}
    step = core.step

    def counting_step():
        output = step()
        stats = output.scheduler_stats
        if stats is not None and stats.kv_connector_stats is not None:
            counts["loaded"] += stats.kv_connector_stats.loaded_tokens
            tier_stats = stats.kv_connector_stats.tiers.get(tier)
            counts["hits"] += tier_stats.hits if tier_stats is not None else 0
        return output

    assert core.kv_cache_manager.reset_prefix_cache()  # what remains is in the tier
    core.step = counting_step
    try:
        outputs, _ = run_to_completion(core, prompts, params_of, prefix)
    finally:
        del core.step
    return outputs, counts["hits"], counts["loaded"]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("budget", [512, 24])
def test_gemma_greedy_parity_with_hits_from_the_cpu_tier(arch, budget):
    core = make_engine(
        tiny_model_path(arch),
        num_blocks=512,
        bytes_per_block=BYTES_PER_BLOCK,
        budget=budget,
        max_num_seqs=NUM_PROMPTS,
        max_model_len=MAX_MODEL_LEN,
    )
    assert isinstance(core.kv_cache_manager, HybridKVCacheManager)
    first, first_hits, _ = run(core, parity_prompts(), parity_greedy, "first-")
    assert first_hits == 0
    second, hits, loaded = run(core, parity_prompts(), parity_greedy, "second-")
    assert hits > 0 and loaded > 0
    assert_matches_hf(arch, first)
    assert_matches_hf(arch, second)


def test_a_fresh_gemma3_engine_loads_from_the_disk_tier_another_filled(tmp_path):
    settings = dict(
        num_blocks=512,
        bytes_per_block=BYTES_PER_BLOCK,
        budget=24,
        max_num_seqs=NUM_PROMPTS,
        max_model_len=MAX_MODEL_LEN,
        tier={"type": "disk", "path": str(tmp_path), "max_bytes": 1 << 28},
    )
    first, _, _ = run(
        make_engine(tiny_model_path("gemma3_text"), **settings),
        parity_prompts(),
        parity_greedy,
        "a-",
        "disk",
    )
    fresh = make_engine(tiny_model_path("gemma3_text"), **settings)
    second, hits, loaded = run(fresh, parity_prompts(), parity_greedy, "b-", "disk")
    assert hits > 0 and loaded > 0
    assert_matches_hf("gemma3_text", first)
    assert_matches_hf("gemma3_text", second)


@pytest.mark.parametrize("budget", [windowed.BUDGET, 512])
def test_windowed_mistral_greedy_parity_with_hits_from_the_cpu_tier(budget):
    output_len = 48
    core = make_engine(
        windowed.model_path(windowed.WINDOWED),
        num_blocks=windowed.NUM_BLOCKS if budget == windowed.BUDGET else 64,
        bytes_per_block=windowed.bytes_per_block(windowed.WINDOWED),
        budget=budget,
        max_num_seqs=4,
        max_model_len=windowed.MAX_MODEL_LEN,
    )
    assert isinstance(core.kv_cache_manager, LocalAttentionManager)
    prompts = windowed.prompts()
    first, _, _ = run(core, prompts, windowed.greedy(output_len), "first-")
    second, hits, loaded = run(core, prompts, windowed.greedy(output_len), "second-")
    # The 70-token prompt loads 64 tokens and the 41-token one 32 (whole chunks; a window of
    # 24 reads only the tier's chunks that hold its tail).
    assert hits > 0 and loaded == 64 + 32
    windowed.assert_equal_to_hf(first, output_len, len(prompts))
    windowed.assert_equal_to_hf(second, output_len, len(prompts))


def test_a_mamba_hybrid_refuses_the_connector_by_name():
    with pytest.raises(ValueError, match=r"kv_transfer_config.*state layers"):
        make_engine(
            tiny_model_path("bamba"),
            num_blocks=64,
            bytes_per_block=KV_BYTES_PER_BLOCK + NUM_PROMPTS * STATE_BYTES_PER_REQUEST // 64,
            budget=512,
            max_num_seqs=NUM_PROMPTS,
            max_model_len=MAX_MODEL_LEN,
        )


def test_a_window_model_with_speculative_decoding_refuses_the_connector_by_name():
    config = transfer_config(CPU_TIER)
    drafts = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
    executor = InProcessExecutor(
        windowed.model_path(windowed.WINDOWED),
        dtype="float32",
        max_model_len=windowed.MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
        kv_cache_memory=64 * windowed.bytes_per_block(windowed.WINDOWED),
        seed=0,
        speculative_config=drafts,
        kv_transfer_config=config,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=windowed.MAX_MODEL_LEN,
        enable_prefix_caching=True,
        num_lookahead_tokens=drafts.num_lookahead_tokens,
        num_speculative_tokens=drafts.num_speculative_tokens,
    )
    with pytest.raises(ValueError, match=r"kv_transfer_config.*speculative decoding"):
        EngineCore(executor, scheduler, executor.grammar_compiler, kv_transfer_config=config)
