"""The openai-client suite of ``test_http_server`` again, against a server started with
``--speculative-config`` (prompt lookup), streaming included; and the spec-decode metrics move.

The suite's tests are collected here a second time with this module's ``engine_args``; a second
run of the whole suite is a long sweep, so it runs in the slow session
(``nox -s "slow(package='server')"``). The default session covers the counters and the log line in
``test_spec_decode_metrics.py`` and speculation end to end in the root ``tests/test_spec_decode.py``.
"""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
from test_http_server import *  # noqa: F403  (the suite, re-collected with these engine args)
from test_http_server import MODEL_NAME, PROMPTS

from ember_server.engine.engine_args import EngineArgs

pytestmark = pytest.mark.slow

SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module")
def engine_args(tiny_model) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    namespace = parser.parse_args(
        [
            "--model",
            str(tiny_model("llama")),
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "16",
            "--kv-cache-memory",
            str(2 * 1024**2),
            "--served-model-name",
            MODEL_NAME,
            "--speculative-config",
            json.dumps(SPECULATIVE_CONFIG),
        ]
    )
    return EngineArgs.from_cli_args(namespace)


def test_spec_decode_metrics_move(server, client):
    before = server.metric("ember:spec_decode_num_draft_tokens_total")
    # A prompt that repeats itself: the greedy continuation of a tiny model soon loops too.
    client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0] * 4, max_tokens=48, temperature=0.0
    )
    drafted = server.wait_for_metric(
        "ember:spec_decode_num_draft_tokens_total", lambda v: v > before
    )
    assert server.metric("ember:spec_decode_num_drafts_total") > 0
    accepted = server.metric("ember:spec_decode_num_accepted_tokens_total")
    assert 0 <= accepted <= drafted
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert (
        'ember:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-llama",position="0"}'
        in metrics
    )
