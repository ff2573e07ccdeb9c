"""``ember proxy`` in front of a prefill (kv_producer) and a decode (kv_consumer) server that
share a disk tier: the client gets the single-instance greedy text, and the decode server loads
the prompt's whole chunks instead of computing them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_thread import ServerThread

from ember_scheduler.sampling_params import SamplingParams
from ember_server.cli.main import make_parser
from ember_server.cli.pd_proxy import build_proxy_app, prefill_request
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.llm import LLM

CHUNK = 32
PROMPT = (
    "def parse(self, text):\n    tokens = text.split()\n    return [t for t in tokens if t]\n" * 3
)


def _args(model, role, path) -> EngineArgs:
    tier = {"type": "disk", "path": str(path), "max_bytes": 1 << 28}
    config = {"kv_connector": "TieredConnector", "kv_role": role,
              "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": [tier]}}  # fmt: skip
    return EngineArgs(model=model, dtype="float32", max_model_len=1024, kv_cache_memory=1 << 22,
                      kv_transfer_config=config)  # fmt: skip


async def _ask(app, body: dict) -> tuple[int, str]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://proxy", timeout=120
    ) as client:
        if not body.get("stream"):
            reply = await client.post("/v1/completions", json=body)
            return reply.status_code, reply.json()["choices"][0][
                "text"
            ] if reply.status_code == 200 else reply.text
        text = ""
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return reply.status_code, text


def test_proxy_serves_single_instance_text_from_the_decode_server(tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    [expected] = LLM(model, dtype="float32", max_model_len=1024, kv_cache_memory=1 << 22).generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    num_prompt_tokens = len(expected.prompt_token_ids)
    with (
        ServerThread(_args(model, "kv_producer", tmp_path)) as prefill,
        ServerThread(_args(model, "kv_consumer", tmp_path)) as decode,
    ):
        app = build_proxy_app(prefill.base_url, decode.base_url)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}

        async def session():  # one event loop: the proxy's HTTP client lives in it
            whole = await _ask(app, body)
            loaded = decode.metric("ember:kv_connector_loaded_tokens_total")
            streamed = await _ask(app, {**body, "stream": True})
            refused = await _ask(app, {**body, "max_tokens": -1})
            return whole, loaded, streamed, refused

        whole, loaded, streamed, refused = asyncio.run(session())
        assert whole == (200, expected.outputs[0].text)
        assert loaded == (num_prompt_tokens - 1) // CHUNK * CHUNK
        assert prefill.metric("ember:kv_connector_loaded_tokens_total") == 0
        # Streamed, the same text (the decode server's own prefix cache serves it now).
        assert streamed == (200, expected.outputs[0].text)
        assert refused[0] == 400 and "max_tokens" in refused[1]  # the prefill server's error


def test_prefill_request_asks_for_one_token_without_streaming():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {}, "n": 2}
    assert prefill_request(body) == {"prompt": "x", "max_tokens": 1, "n": 1}


def test_proxy_command_needs_both_urls():
    with pytest.raises(SystemExit):
        make_parser().parse_args(["proxy", "--prefill", "http://a:1"])
    args = make_parser().parse_args(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2"])
    assert (args.prefill, args.decode, args.port) == ("http://a:1", "http://b:2", 8000)


def test_bad_kv_transfer_config_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_role must be one of"):
        EngineArgs(
            model="m", kv_transfer_config={"kv_connector": "TieredConnector", "kv_role": "x"}
        )
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--kv-transfer-config", "{not json"])
    args = make_parser().parse_args(
        [
            "serve",
            "--kv-transfer-config",
            json.dumps(_args("m", "kv_both", "/tmp").kv_transfer_config),
        ]
    )
    assert args.kv_transfer_config["kv_role"] == "kv_both"
