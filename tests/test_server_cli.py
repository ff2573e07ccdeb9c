"""End to end: ``ember serve`` as a user runs it (no model: the demo model), over HTTP.

The server is a real child process bound to 127.0.0.1 on a free port; it is stopped with Ctrl-C
(SIGINT) and must take its engine core process with it.
"""

from __future__ import annotations

import importlib.metadata
import json
import signal

import httpx
import pytest

from ember import LLM, SamplingParams
from ember_server.cli.demo_model import DEMO_MODEL_NAME, demo_model_path
from ember_testing.serve_process import ServeProcess, child_pids, wait_gone

FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "8",
    "--kv-cache-memory",
    "8MiB",
]
PROMPTS = ["def parse(self, text):", "Grüße aus Köln, 日本語"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with ServeProcess(FLAGS, tmp_path_factory.mktemp("serve")) as server:
        yield server.process, server.base_url, server.log


def test_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert any(s.name == "ember" and s.value == "ember_server.cli.main:main" for s in scripts)


def test_demo_model_is_announced_plainly(served):
    _, base_url, log = served
    text = log.read_text()
    assert "built-in demo model" in text and "RANDOM weights" in text
    assert demo_model_path() in text
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [DEMO_MODEL_NAME]


def test_served_greedy_text_equals_offline_api(served):
    _, base_url, _ = served
    url = f"{base_url}/v1/completions"
    body = dict(model=DEMO_MODEL_NAME, max_tokens=12, temperature=0.0)
    served_texts = [
        httpx.post(url, json={**body, "prompt": p}, timeout=60).json()["choices"][0]["text"]
        for p in PROMPTS
    ]
    with httpx.stream("POST", url, json={**body, "prompt": PROMPTS[1], "stream": True}) as r:
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    llm = LLM(
        demo_model_path(),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory=8 * 1024**2,
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        offline = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert served_texts == [o.outputs[0].text for o in offline]
    assert streamed == served_texts[1]


def test_ctrl_c_stops_server_and_engine(served):
    process, base_url, log = served
    engines = child_pids(process.pid)
    assert engines, "the engine core runs in a child process"
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 0, log.read_text()
    assert wait_gone(engines, 30), "the engine core outlived the server"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base_url}/health", timeout=2)
