"""``ember run-batch``: one result per input line, in order, in OpenAI's batch output format;
broken lines get errors and never stop the batch; results equal the offline engine's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ember_scheduler import SamplingParams
from ember_server.cli.main import main
from ember_server.engine.llm import LLM


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_mixed_batch_gives_one_result_per_line_in_order(tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    completion = {"prompt": "def main():", "max_tokens": 8, "temperature": 0.0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    lines = [
        _line("cmpl", "/v1/completions", completion),
        "{not json",
        _line("chat", "/v1/chat/completions", chat),
        _line("emb", "/v1/embeddings", {"input": ["hello", "world"]}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": completion}),
        _line("bad-url", "/v1/images", {}),
        _line("bad-field", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}),
        _line("get", "/v1/completions", completion, method="GET"),
        _line("emb-ids", "/v1/embeddings", {"input": [1, 2, 3], "encoding_format": "base64"}),
    ]
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(requests), "-o", str(results), model,
                 "--max-model-len", "512", "--num-threads", "1", "--dtype", "float32"]) == 0  # fmt: skip

    out = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [
        "cmpl", None, "chat", "emb", None, "bad-url", "bad-field", "get", "emb-ids"
    ]  # fmt: skip
    ok = {0, 2, 3, 8}
    for index, result in enumerate(out):
        assert result["id"].startswith("batch_req_")
        if index in ok:
            assert result["error"] is None and result["response"]["status_code"] == 200
        elif index == 6:  # a request the route refuses: its 400 and OpenAI error body
            assert result["response"]["status_code"] == 400
            assert result["response"]["body"]["error"]["param"] == "max_tokens"
        else:  # not a request at all
            assert result["response"] is None and result["error"]["message"]
    assert "url must be one of" in out[5]["error"]["message"]
    assert "custom_id" in out[4]["error"]["message"]

    llm = LLM(model, dtype="float32", max_model_len=512)
    expected = llm.generate("def main():", SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0]["response"]["body"]["choices"][0]["text"] == expected[0].outputs[0].text
    assert out[2]["response"]["body"]["object"] == "chat.completion"
    embeddings = llm.embed(["hello", "world"], use_tqdm=False)
    data = out[3]["response"]["body"]["data"]
    for got, want in zip(data, embeddings):
        np.testing.assert_allclose(got["embedding"], want.outputs.embedding, atol=1e-5)
    assert isinstance(out[8]["response"]["body"]["data"][0]["embedding"], str)
    llm.shutdown()


def test_an_unreadable_input_or_unwritable_output_fails_before_the_engine_starts(
    tiny_model, tmp_path
):
    model = str(tiny_model("llama"))  # a real folder: the model check passes, the file check fails
    requests = tmp_path / "requests.jsonl"
    requests.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    for input_path, output_path in (
        (tmp_path / "missing.jsonl", tmp_path / "out.jsonl"),
        (requests, tmp_path / "no-such-dir" / "out.jsonl"),
    ):
        with pytest.raises(SystemExit, match="ember run-batch: error: cannot open"):
            main(["run-batch", "-i", str(input_path), "-o", str(output_path), model])
