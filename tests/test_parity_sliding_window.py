"""A sliding-window model served with its window's memory, token for token equal to transformers.

The KV cache holds fewer than 200 tokens, yet the engine accepts a context far longer and
generates 1,000 tokens: the blocks that leave the window go back to the pool each step. Also
with chunked prefill, under preemption (more requests than the pool's blocks serve at once) and
with prefix-cache hits on the window's tail when preempted requests resume.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_parity import (
    NUM_PROMPTS,
    assert_matches_hf,
    bytes_per_block,
    hf_model,
    model_path,
    parity_prompts,
    run,
)
from test_parity import greedy as parity_greedy
from test_parity import make_engine as make_parity_engine

from ember_kv_cache import HybridKVCacheManager, LocalAttentionManager, SlidingWindowSpec
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.sampling_params import SamplingParams
from ember_spec_decode import SpeculativeConfig
from ember_worker.executor import InProcessExecutor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 24
WINDOWED = ("mistral", (("max_position_embeddings", 2048), ("sliding_window", WINDOW)))
BLOCK_SIZE = 16
NUM_BLOCKS = 12  # the null block and 11 usable: 176 tokens of KV
MAX_MODEL_LEN = 2048
BUDGET = 32  # tokens per step: a step of one request needs ceil((24 - 1 + 32) / 16) + 1 = 5


def make_engine(*, prefix_caching: bool = False, num_blocks: int = NUM_BLOCKS) -> EngineCore:
    executor = InProcessExecutor(
        model_path(WINDOWED),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * bytes_per_block(WINDOWED),
        seed=0,
    )
    assert executor.num_kv_blocks == num_blocks
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=prefix_caching,
    )
    return EngineCore(executor, config, executor.grammar_compiler)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (70, 9, 41)]


@functools.cache
def hf_greedy(output_len: int) -> tuple[tuple[int, ...], ...]:
    model = hf_model(WINDOWED)
    outs = []
    with torch.no_grad():
        for prompt in prompts():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=output_len, do_sample=False, pad_token_id=0
            )
            outs.append(tuple(out[0, len(prompt) :].tolist()))
    return tuple(outs)


def greedy(output_len: int):
    return lambda _i: SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def assert_equal_to_hf(outputs: dict, output_len: int, num_prompts: int) -> None:
    for i, want in enumerate(hf_greedy(output_len)[:num_prompts]):
        got = tuple(outputs[i]["tokens"])
        assert len(set(want)) >= 8, f"prompt {i}: trivial reference"
        first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"prompt {i}: first difference at {first}"


def test_a_thousand_tokens_from_a_cache_of_under_200_tokens():
    core = make_engine()
    assert isinstance(core.kv_cache_manager, LocalAttentionManager)
    assert (NUM_BLOCKS - 1) * BLOCK_SIZE < 200
    # Full attention could hold 176 tokens; the window serves the whole context.
    assert core.max_num_tokens == MAX_MODEL_LEN
    outputs, _ = run(core, prompts()[:1], greedy(1000))
    assert len(outputs[0]["tokens"]) == 1000
    assert_equal_to_hf(outputs, 1000, 1)
    assert core.kv_cache_manager.usage == 0.0


def test_chunked_prefill_and_preemption_in_a_small_pool():
    # Three requests holding up to 3 blocks each do not fit 6 blocks at once: someone is preempted
    # and recomputes; the 70-token prompt prefills in chunks of at most 32.
    outputs, totals = run(make_engine(num_blocks=7), prompts(), greedy(80))
    assert totals["num_preemptions"] > 0
    assert_equal_to_hf(outputs, 80, 3)


def test_prefix_cache_hits_on_the_window_tail_when_preempted_requests_resume():
    core = make_engine(prefix_caching=True, num_blocks=7)
    outputs, totals = run(core, prompts(), greedy(80))
    assert totals["num_preemptions"] > 0
    assert totals["prefix_cache_hits"] > 0
    assert_equal_to_hf(outputs, 80, 3)
    # A prompt asked again, in a pool roomy enough to keep its blocks: the blocks its next query
    # sees (positions 41 to 63 of 70) are what the hit needs, those before them were freed.
    core = make_engine(prefix_caching=True)
    run(core, prompts()[:1], greedy(8), prefix="first-")
    again, totals = run(core, prompts()[:1], greedy(80), prefix="again-")
    assert totals["prefix_cache_hits"] == 64
    assert_equal_to_hf(again, 80, 1)


def test_windows_on_some_layers_keep_a_block_table_per_group():
    """Qwen2 with a window on its second layer only: two KV groups (full, window of 24), each
    with its own table, one cache tensor shared (a block spans one of the two layers)."""
    model = (
        "qwen2",
        (("max_window_layers", 1), ("sliding_window", 24), ("use_sliding_window", True)),
    )
    num_blocks = 40
    for budget in (512, 20):
        executor = InProcessExecutor(
            model_path(model),
            dtype="float32",
            max_model_len=256,
            max_num_seqs=NUM_PROMPTS,
            max_num_batched_tokens=budget,
            block_size=BLOCK_SIZE,
            kv_cache_memory=num_blocks * bytes_per_block(model) // 2,
            seed=0,
        )
        assert executor.num_kv_blocks == num_blocks
        config = SchedulerConfig(
            max_num_seqs=NUM_PROMPTS, max_num_batched_tokens=budget, max_model_len=256
        )
        core = EngineCore(executor, config, executor.grammar_compiler)
        assert isinstance(core.kv_cache_manager, HybridKVCacheManager)
        outputs, totals = run(core, parity_prompts(), parity_greedy)
        assert totals["num_preemptions"] > 0
        assert_matches_hf(model, outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_window_with_ngram_drafts_in_flight(async_scheduling):
    """Drafts scheduled as if accepted, then rejected, roll a request back: its window still
    holds what the rolled-back queries read (the manager keeps the drafts' worth more)."""
    model = ("mistral", (("sliding_window", 24),))
    core = make_parity_engine(
        model,
        num_blocks=40,
        max_num_batched_tokens=64,
        speculative_config=SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3),
        async_scheduling=async_scheduling,
    )
    assert isinstance(core.kv_cache_manager, LocalAttentionManager)
    assert core.kv_cache_manager.spec == SlidingWindowSpec(28)
    outputs, totals = run(core, parity_prompts(), parity_greedy)
    assert totals["num_draft_tokens"] > totals["num_accepted_tokens"] > 0
    assert_matches_hf(model, outputs)
