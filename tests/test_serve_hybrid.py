"""``ember serve`` on models whose layers keep different things: Gemma 3 (interleaved sliding
and global layers) and Bamba (Mamba-2 mixers beside attention), through the OpenAI client. The
checks are ``test_serve_moe``'s: completions (with logprobs), chat and streamed chat answer as
the offline API does, whose tokens the parity suites hold to transformers'."""

from __future__ import annotations

import openai
import pytest
from test_serve_moe import FLAGS, check_openai_answers_match_offline

from ember_testing.serve_process import ServeProcess
from ember_testing.tiny_models import tiny_model_path


@pytest.fixture(scope="module", params=["gemma3_text", "bamba"])
def served(request, tmp_path_factory):
    path = str(tiny_model_path(request.param))
    with ServeProcess([path, *FLAGS], tmp_path_factory.mktemp("serve")) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        yield path, client


def test_completions_and_chat_match_the_offline_api(served):
    check_openai_answers_match_offline(*served)
