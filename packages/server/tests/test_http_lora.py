"""LoRA adapters over HTTP through the openai client: ``--lora-modules`` served by the ``model``
field, ``/v1/models`` listing them with their parent, 404 for an unknown model, adapters loaded
and unloaded at run time (behind EMBER_ALLOW_RUNTIME_LORA_UPDATING; an unload lets a request in
flight finish), and ``ember:lora_requests_info``. Greedy text equals transformers running the
PEFT-merged model in float32."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_thread import ServerThread
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember_scheduler.lora import LoRAConfig
from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.api_server import build_app
from ember_server.openai.lora_routes import RUNTIME_UPDATING_ENV
from ember_testing.tiny_lora import merged_hf_model, tiny_lora_path

pytest.importorskip("peft")

PROMPT = [1, 40, 41, 42, 50, 60, 61, 70]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base):
    return {
        "sql": tiny_lora_path(base, seed=21, r=8, lora_alpha=16),
        "chat": tiny_lora_path(
            base, seed=22, r=4, lora_alpha=8, target_modules=("q_proj", "o_proj", "up_proj")
        ),
    }


@pytest.fixture(scope="module")
def server(base, adapters):
    patch = pytest.MonkeyPatch()
    patch.setenv(RUNTIME_UPDATING_ENV, "1")
    args = EngineArgs(
        model=str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=2,
        max_model_len=1024,
        kv_cache_memory=4 * 1024**2,
        num_threads=1,
    )
    try:
        with ServerThread(args, lora_modules={"sql": str(adapters["sql"])}) as server:
            yield server
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _expected_text(base, adapter, max_tokens: int = MAX_TOKENS) -> str:
    hf = (
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if adapter is None
        else merged_hf_model(base, adapter)
    )
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return AutoTokenizer.from_pretrained(base).decode(out[0, len(PROMPT) :])


def _complete(client, model: str, max_tokens: int = MAX_TOKENS) -> str:
    reply = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert reply.model == model
    return reply.choices[0].text


def test_models_list_adapters_with_their_parent(client, server, base, adapters):
    cards = {card.id: card for card in client.models.list().data}
    base_name = server.engine.served_model_name
    assert set(cards) == {base_name, "sql"}
    assert cards["sql"].parent == base_name
    assert cards["sql"].root == str(adapters["sql"])
    assert getattr(cards[base_name], "parent", None) is None


def test_the_model_field_chooses_the_adapter(client, server, base, adapters):
    assert _complete(client, "sql") == _expected_text(base, adapters["sql"])
    assert _complete(client, server.engine.served_model_name) == _expected_text(base, None)
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert {chunk.model for chunk in chat} == {"sql"}
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "nope")
    assert info.value.body["type"] == "not_found_error"
    assert "nope" in info.value.body["message"]


def test_load_run_unload_with_a_request_in_flight(client, server, base, adapters):
    url = server.base_url
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": str(adapters["chat"])},
    )
    assert loaded.status_code == 200, loaded.text
    assert "chat" in {card.id for card in client.models.list().data}
    expected = _expected_text(base, adapters["chat"])
    assert _complete(client, "chat") == expected
    # A request in flight when its adapter is unloaded runs to its end, with the adapter. Its
    # first chunk is read before the unload and about 900 more steps follow, so that the
    # unload's round trip, even on a loaded machine, ends long before the request does. Its text
    # is the same request's run with the adapter loaded throughout (over 900 tokens of a random
    # model, greedy float32 drifts from transformers' at a near tie; the short run above holds it
    # to transformers).
    long = 900
    with_adapter = _complete(client, "chat", long)
    stream = client.completions.create(
        model="chat", prompt=PROMPT, max_tokens=long, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert unloaded.status_code == 200, unloaded.text
    assert server.engine.num_requests_in_flight == 1  # still running after the unload
    text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == with_adapter
    assert with_adapter != _complete(client, server.engine.served_model_name, long)  # it shows
    with pytest.raises(openai.NotFoundError):
        _complete(client, "chat")
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


def test_bad_runtime_loads_get_openai_errors(server, base, tiny_model, tmp_path):
    url = server.base_url
    taken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    missing = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": str(tmp_path)}
    )
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    big = tiny_lora_path(base, seed=23, r=16, lora_alpha=16, target_modules=("q_proj",))
    too_big = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)}
    )
    assert too_big.status_code == 400 and "max_lora_rank" in too_big.json()["error"]["message"]


def test_lora_requests_info_metric(client, server):
    _complete(client, "sql", max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("ember:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0]


def test_runtime_routes_need_the_opt_in(server, monkeypatch):
    monkeypatch.delenv(RUNTIME_UPDATING_ENV)
    paths = {route.path for route in build_app(server.engine).routes}
    assert "/v1/load_lora_adapter" not in paths and "/v1/models" in paths


def test_serve_flags_parse_into_engine_args_and_lora_modules():
    from ember_server.cli.main import make_parser

    args = make_parser().parse_args(
        ["serve", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
         "--max-cpu-loras", "5", "--lora-modules", "a=/x", "b=/y/z"]
    )  # fmt: skip
    args.model = "m"  # the CLI resolves the positional model (or the demo model) itself
    assert EngineArgs.from_cli_args(args).lora_config == LoRAConfig(3, 32, 5)
    assert dict(args.lora_modules) == {"a": "/x", "b": "/y/z"}
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "m", "--lora-modules", "no-equals-sign"])


@pytest.mark.slow
def test_adapters_behind_two_data_parallel_engines(base, adapters, monkeypatch):
    """``-dp 2``: served and run-time-loaded adapters and the base model, the requests spread
    over both engine processes (each loads the adapters of its own requests); greedy text
    equals the merged models'."""
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "1")
    args = EngineArgs(
        model=str(base),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=128,
        kv_cache_memory=4 * 1024**2,
        num_threads=1,
        data_parallel_size=2,
    )
    with ServerThread(args, lora_modules={"sql": str(adapters["sql"])}) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        loaded = httpx.post(
            f"{server.base_url}/v1/load_lora_adapter",
            json={"lora_name": "chat", "lora_path": str(adapters["chat"])},
        )
        assert loaded.status_code == 200, loaded.text
        base_name = server.engine.served_model_name
        expected = {
            "sql": _expected_text(base, adapters["sql"]),
            "chat": _expected_text(base, adapters["chat"]),
            base_name: _expected_text(base, None),
        }
        for model in ("sql", base_name, "chat", "chat", base_name, "sql"):
            assert _complete(client, model) == expected[model], model
        routed = httpx.get(f"{server.base_url}/metrics").text
        engines = {
            line.split('engine="')[1].split('"')[0]
            for line in routed.splitlines()
            if line.startswith("ember:dp_routed_requests_total{") and not line.endswith(" 0.0")
        }
        assert len(engines) == 2, routed
