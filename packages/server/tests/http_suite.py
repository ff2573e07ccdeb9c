"""The server, its OpenAI client and engine settings that the OpenAI-route suites share
(``test_http_server``, ``test_http_server_robustness``): each module that imports the fixtures
starts its own server (module scope), behind an API key."""

from __future__ import annotations

import openai
import pytest
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs

MODEL_NAME = "tiny-llama"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["def main(argv):\n    ", "The quick brown fox", "import json\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(
    scope="module",
    params=[
        ("llama", 1),
        pytest.param(("llama", 2), marks=pytest.mark.slow),
        pytest.param(("gemma3_text", 1), marks=pytest.mark.slow),
    ],
    ids=["dp1", "dp2", "gemma3"],
)
def engine_args(tiny_model, request) -> EngineArgs:
    """The suite runs against one engine core, and (slow) against two behind one server, and
    against a model with sliding-window and global layers (one KV block table each)."""
    arch, data_parallel_size = request.param
    return EngineArgs(
        model=str(tiny_model(arch)),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=16,
        kv_cache_memory=2 * 1024**2,
        served_model_name=MODEL_NAME,
        data_parallel_size=data_parallel_size,
    )


@pytest.fixture(scope="module")
def server(engine_args):
    with ServerThread(engine_args, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
