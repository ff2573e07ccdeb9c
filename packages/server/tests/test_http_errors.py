"""Error handlers: every failure becomes an OpenAI-format error with the right status."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ember_server.openai.errors import OpenAIError, from_value_error, install_error_handlers
from ember_server.openai.protocol import ErrorResponse
from ember_server.openai.protocol_completion import CompletionRequest


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        if request.model == "nope":
            raise OpenAIError("The model `nope` does not exist.", 404, "model")
        return {"ok": request.prompts()}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("bug")

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return ErrorResponse.model_validate(response.json()).error.model_dump()


def test_malformed_json(client):
    response = client.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    err = _error(response, 400)
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["message"].startswith("Malformed JSON body")


def test_body_not_an_object(client):
    err = _error(client.post("/v1/completions", json=[1, 2]), 400)
    assert err["code"] == 400


def test_missing_field_names_it(client):
    err = _error(client.post("/v1/completions", json={"model": "m"}), 400)
    assert err["param"] == "prompt"
    assert "prompt" in err["message"] and "required" in err["message"].lower()


def test_wrong_type_names_it(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": "ten"}), 400)
    assert err["param"] == "max_tokens"


def test_union_member_names_are_not_in_the_param(client):
    err = _error(client.post("/v1/completions", json={"prompt": 3}), 400)
    assert err["param"] == "prompt"


def test_validator_errors_name_their_field(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400)
    assert (err["param"], err["message"]) == ("best_of", "best_of other than n is not supported")


def test_raised_openai_error_keeps_status_and_param(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404)
    assert (err["type"], err["param"]) == ("not_found_error", "model")


def test_unknown_route_and_method(client):
    assert _error(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert _error(client.get("/v1/completions"), 405)["code"] == 405


def test_bug_is_a_500_in_the_same_format(client):
    err = _error(client.get("/boom"), 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]


def test_good_request_passes(client):
    response = client.post("/v1/completions", json={"prompt": [1, 2]})
    assert response.status_code == 200 and response.json() == {"ok": [[1, 2]]}


def test_value_error_from_sampling_params_names_the_field():
    with pytest.raises(ValueError) as info:
        CompletionRequest(prompt="x", top_p=5.0).to_sampling_params(max_tokens=1)
    err = from_value_error(info.value)
    assert (err.status, err.param) == (400, "top_p")
