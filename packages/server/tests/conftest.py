"""Fixtures shared by the server tests."""

import asyncio

import pytest
from transformers import AutoTokenizer

from ember_server.engine.input_processor import InputProcessor
from ember_server.engine.model_config import ModelConfig


@pytest.fixture(scope="module")
def loop():
    """One event loop per module: engines and async clients belong to the loop they start on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_path):
    """The tiny models' tokenizer (the demo model's byte-level BPE)."""
    return AutoTokenizer.from_pretrained(test_tokenizer_path)


@pytest.fixture
def inputs(tokenizer):
    """An ``InputProcessor`` of ``tokenizer`` with small limits (64-token context, 40 KV tokens)
    and a second end-of-sequence id, 7, beside eos 2."""
    config = ModelConfig(
        model="m", tokenizer="m", served_model_name="m", max_model_len=64,
        max_num_batched_tokens=64, vocab_size=len(tokenizer), eos_token_id=2,
        extra_eos_token_ids=(7,), bos_token_id=1,
    )  # fmt: skip
    return InputProcessor(tokenizer, config, max_num_kv_tokens=40)
