"""An engine whose KV cache cannot hold one sequence of max_model_len tokens never starts quietly:
a given max_model_len is refused with both numbers and the fix, the model's own is lowered."""

from __future__ import annotations

import asyncio
import logging

import pytest
from transformers import AutoConfig

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.core_client import EngineStartupError
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.llm import LLM

BLOCK_SIZE = 16
NUM_BLOCKS = 8  # one is the pool's null block: 112 tokens hold one sequence, as in the report
CAPACITY = 112


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("llama"))


def _bytes_for(model: str, num_blocks: int) -> int:
    """KV bytes of ``num_blocks`` float32 blocks of this model (K and V, every layer)."""
    config = AutoConfig.from_pretrained(model)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    return num_blocks * BLOCK_SIZE * per_token


def test_given_max_model_len_over_the_cache_is_refused_with_both_numbers_and_the_fix(model):
    memory = _bytes_for(model, NUM_BLOCKS)
    with pytest.raises(ValueError) as refused:
        LLM(
            model, dtype="float32", max_model_len=256, kv_cache_memory=memory, block_size=BLOCK_SIZE
        )
    message = str(refused.value)
    assert "max_model_len 256" in message and "112 tokens" in message
    # 256 tokens are 16 blocks, plus the null block.
    assert f"at least {_bytes_for(model, 17)} bytes" in message and "--kv-cache-memory" in message
    # The same through the engine core process: a start-up failure the CLI reports as bad settings.
    args = EngineArgs(model=model, dtype="float32", max_model_len=256, kv_cache_memory=memory)
    with pytest.raises(EngineStartupError, match="max_model_len 256") as failed:
        asyncio.run(AsyncLLM.start(args))
    assert failed.value.bad_settings


def test_the_models_own_context_is_lowered_to_what_fits(model, caplog):
    memory = _bytes_for(model, NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="ember_server.engine.engine_factory"):
        llm = LLM(model, dtype="float32", kv_cache_memory=memory, block_size=BLOCK_SIZE)
    try:
        assert llm.model_config.max_model_len == CAPACITY
        assert "lowering max_model_len" in caplog.text
    finally:
        llm.shutdown()

    async def served_context() -> int:
        engine = await AsyncLLM.start(
            EngineArgs(model=model, dtype="float32", kv_cache_memory=memory)
        )
        try:
            return engine.model_config.max_model_len
        finally:
            await engine.shutdown()

    assert asyncio.run(served_context()) == CAPACITY


def test_a_window_model_takes_a_context_beyond_its_cache(tiny_model):
    """Mistral with a window of 16: a request holds its window's blocks, not its context's, so
    112 tokens of cache serve max_model_len 1024 (steps of at most 32 new tokens need 4 blocks)."""
    model = str(tiny_model("mistral", sliding_window=16))
    llm = LLM(
        model,
        max_model_len=1024,
        kv_cache_memory=_bytes_for(model, NUM_BLOCKS),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=32,
        dtype="float32",
    )
    try:
        assert llm.model_config.max_model_len == 1024
        out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=300, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 300  # a context past the 112 tokens
    finally:
        llm.shutdown()
