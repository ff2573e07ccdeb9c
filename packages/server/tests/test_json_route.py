"""The routes' JSON bodies: msgspec decodes them as the standard library does."""

from __future__ import annotations

import asyncio
import json

import pytest

from ember_server.openai.json_route import MsgspecJSONRequest


def _decode(body: bytes):
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    request = MsgspecJSONRequest({"type": "http", "method": "POST", "headers": []}, receive)
    return asyncio.run(request.json())


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": [1, 2, 3], "temperature": 0.5, "stop": ["\\n", "\\u00e9"]}',
        b'{"a": 1, "a": 2}',
        b"123456789012345678901234567890",
        b'["\\ud800", "\\udfff x"]',  # lone surrogates: msgspec refuses them, json takes them
        b"[NaN, Infinity, -Infinity, 1e400]",
        b" [1] ",
    ],
)
def test_bodies_decode_as_with_the_standard_library(body):
    assert repr(_decode(body)) == repr(json.loads(body))


@pytest.mark.parametrize("body", [b'{"prompt": [1, 2', b"", b"{'a': 1}", b"[1,]"])
def test_malformed_bodies_raise_the_standard_librarys_error(body):
    with pytest.raises(json.JSONDecodeError):
        _decode(body)
