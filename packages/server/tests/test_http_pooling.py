"""The pooling routes of a real server: ``/v1/embeddings`` through the official ``openai``
client (float and base64) against transformers, ``/classify``, ``/score`` and ``/rerank`` against
the offline ``LLM``, bad input answered with 400s, and one generate engine serving completions
and embeddings side by side with its greedy text unchanged."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
import torch
from server_thread import ServerThread
from transformers import AutoModel, AutoTokenizer

from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.llm import LLM

TOLERANCE = 1e-4
TEXTS = ["def main():\n    return 0", "The quick brown fox. " * 20, "x"]


def _args(path, **kwargs) -> EngineArgs:
    return EngineArgs(
        model=str(path),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=64,
        num_threads=1,
        **kwargs,
    )


def _hf_last_hidden(path, texts) -> list[np.ndarray]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [
            model(tokenizer(t, return_tensors="pt").input_ids).last_hidden_state[0, -1].numpy()
            for t in texts
        ]


@pytest.fixture(scope="module")
def generate_server(tiny_model):
    """A generate engine: completions, and embeddings of the same decoder."""
    with ServerThread(_args(tiny_model("qwen3"))) as running:
        yield running


def test_embeddings_through_the_openai_client_match_transformers(generate_server, tiny_model):
    client = openai.OpenAI(base_url=f"{generate_server.base_url}/v1", api_key="x", max_retries=0)
    model = generate_server.engine.served_model_name
    hidden = _hf_last_hidden(tiny_model("qwen3"), TEXTS)
    # Without encoding_format the client asks for base64 and decodes it itself; with "base64"
    # it hands back the string.
    for encoding_format in (openai.NOT_GIVEN, "float", "base64"):
        response = client.embeddings.create(
            model=model, input=TEXTS, encoding_format=encoding_format
        )
        assert [d.index for d in response.data] == [0, 1, 2]
        for data, vector in zip(response.data, hidden):
            embedding = data.embedding
            if encoding_format == "base64":
                embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4")
            expected = vector / np.linalg.norm(vector)
            np.testing.assert_allclose(embedding, expected, atol=TOLERANCE, rtol=0)
        assert response.usage.prompt_tokens == response.usage.total_tokens > 40
    # Token ids, one prompt or several, truncated to 8 dimensions then normalized.
    ids = AutoTokenizer.from_pretrained(tiny_model("qwen3"))(TEXTS[0]).input_ids
    truncated = hidden[0][:8] / np.linalg.norm(hidden[0][:8])
    for given in (ids, [ids, ids]):
        response = client.embeddings.create(model=model, input=given, dimensions=8)
        assert len(response.data) == (1 if given is ids else 2)
        for data in response.data:
            np.testing.assert_allclose(data.embedding, truncated, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "pooling_type", "normalize"),
    [("llama", "mean", True), ("mistral", "cls", False), ("qwen2", "last", False),
     ("qwen3", "mean", False)],
)  # fmt: skip
def test_every_architecture_embeds_over_http(tiny_model, arch, pooling_type, normalize):
    """A pooling server per architecture: float and base64 embeddings of unequal, chunked
    prompts through the openai client match transformers."""
    path = tiny_model(arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    expected = []
    with torch.no_grad():
        for text in TEXTS:
            hidden = model(tokenizer(text, return_tensors="pt").input_ids).last_hidden_state[0]
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
            expected.append((vector / vector.norm() if normalize else vector).numpy())
    with ServerThread(_args(path, runner="pooling", pooling_type=pooling_type)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        for encoding_format in ("float", "base64"):
            response = client.embeddings.create(
                model=server.engine.served_model_name,
                input=TEXTS,
                encoding_format=encoding_format,
                extra_body={"normalize": normalize},
            )
            for data, reference in zip(response.data, expected):
                embedding = data.embedding
                if encoding_format == "base64":
                    embedding = np.frombuffer(base64.b64decode(embedding), dtype="<f4")
                np.testing.assert_allclose(embedding, reference, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 100000}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 2], [99999]]}, "input"),
        ({"input": 5}, "input"),
    ],
)
def test_bad_embedding_requests_are_400s(generate_server, body, param):
    response = httpx.post(f"{generate_server.base_url}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error


def test_classify_on_a_decoder_without_score_head_is_a_400(generate_server):
    response = httpx.post(f"{generate_server.base_url}/classify", json={"input": "x"}, timeout=30)
    assert response.status_code == 400
    assert "cannot classify" in response.json()["error"]["message"]


def test_generation_is_unchanged_with_embedding_traffic_alongside(generate_server):
    base = generate_server.base_url
    body = {"prompt": TEXTS[1], "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    alone = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        embeds = [
            pool.submit(httpx.post, f"{base}/v1/embeddings", json={"input": TEXTS}, timeout=60)
            for _ in range(12)
        ]
        completions = [
            pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
            for _ in range(4)
        ]
        texts = [f.result().json()["choices"][0]["text"] for f in completions]
        assert all(f.result().status_code == 200 for f in embeds)
    assert texts == [alone["choices"][0]["text"]] * 4


def test_classify_score_and_rerank_match_offline(tiny_classifier):
    path = tiny_classifier("llama", num_labels=1)
    offline = LLM(str(path), dtype="float32", max_model_len=512, max_num_batched_tokens=64)
    query, documents = "what is json", ["import json", "the lazy dog", "x", "json.dumps"]
    expected = [s.outputs.score for s in offline.score(query, documents, use_tqdm=False)]
    probs = offline.classify(documents, use_tqdm=False)
    offline.shutdown()
    with ServerThread(_args(path)) as server:
        base = server.base_url
        classified = httpx.post(f"{base}/classify", json={"input": documents}, timeout=60).json()
        for data, output in zip(classified["data"], probs):
            assert data["num_classes"] == 1 and data["label"] == "LABEL_0"
            np.testing.assert_allclose(data["probs"], output.outputs.probs, atol=TOLERANCE)
        scored = httpx.post(
            f"{base}/score", json={"text_1": query, "text_2": documents}, timeout=60
        ).json()
        assert [d["index"] for d in scored["data"]] == [0, 1, 2, 3]
        np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=TOLERANCE)
        reranked = httpx.post(
            f"{base}/rerank", json={"query": query, "documents": documents, "top_n": 3}, timeout=60
        ).json()
        order = sorted(range(4), key=lambda i: -expected[i])[:3]
        assert [r["index"] for r in reranked["results"]] == order
        assert [r["document"]["text"] for r in reranked["results"]] == [documents[i] for i in order]
        assert reranked["usage"]["total_tokens"] > 0
        completion = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=60)
        assert completion.status_code == 400
        assert "runner='pooling'" in completion.json()["error"]["message"]
        mismatch = httpx.post(f"{base}/score", json={"text_1": ["a", "b"], "text_2": ["c"]})
        assert mismatch.status_code == 400
