"""Gemma 2 and Gemma 3 (text) against transformers, greedy tokens equal in float32.

Tiny random checkpoints interleave local layers (a window of 16 tokens, shorter than most
prompts) and global layers; Gemma 2's soft-capping of scores and logits, Gemma 3's q/k norm and
local RoPE base, the query pre-scaling, sandwich norms and scaled embeddings all change the
tokens. Whole and chunked prefill, preemption, prefix-cache hits, all in mixed batches.
"""

from __future__ import annotations

import pytest
from test_parity import assert_matches_hf, greedy, make_engine, parity_prompts, run

from ember_testing.tiny_models import HYBRID_ARCHITECTURES, tiny_model_path
from ember_worker.hf_config import load_hf_config
from ember_worker.models.config import DecoderConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
