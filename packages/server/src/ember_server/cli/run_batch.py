"""``ember run-batch -i requests.jsonl -o results.jsonl MODEL``: an OpenAI batch file, offline.

Each input line is one request, ``{"custom_id", "method": "POST", "url", "body"}``, for
``/v1/completions``, ``/v1/chat/completions`` or ``/v1/embeddings``. Every request goes, all at
once, to one engine through the server's own route handlers (in this process, no port opened),
so validation, errors and response bodies are exactly ``ember serve``'s. The output has one line
per input line, in input order, in OpenAI's batch output format: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``. A line that is not a request (bad
JSON, a missing field, another URL) gets ``response: null`` and an ``error``; a request the
route refuses gets its 4xx status and error body. One bad line never stops the batch.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
from tqdm.auto import tqdm

from ember_server.engine.engine_args import EngineArgs

BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
# Requests in flight at once; the engine's own scheduler batches them.
_MAX_IN_FLIGHT = 512


def parse_line(line: str) -> dict[str, Any]:
    """One batch request from a line; ValueError saying what is wrong with it."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line is not valid JSON: {exc}") from exc
    if not isinstance(item, dict):
        raise ValueError("line must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if item.get("method") != "POST":
        raise ValueError(f"method must be 'POST', got {item.get('method')!r}")
    if item.get("url") not in BATCH_URLS:
        raise ValueError(f"url must be one of {', '.join(BATCH_URLS)}, got {item.get('url')!r}")
    if not isinstance(item.get("body"), dict):
        raise ValueError("body must be a JSON object")
    return item


def _custom_id_of(line: str) -> str | None:
    try:
        custom_id = json.loads(line).get("custom_id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) else None


def _result(custom_id, response=None, error=None) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


async def run_lines(client: httpx.AsyncClient, lines: list[str], progress: tqdm) -> list[dict]:
    """The result of every line, in order, sent through ``client`` (the app's ASGI transport)."""
    slots = asyncio.Semaphore(_MAX_IN_FLIGHT)

    async def run(line: str) -> dict[str, Any]:
        try:
            try:
                item = parse_line(line)
            except ValueError as exc:
                error = {"code": "invalid_request", "message": str(exc)}
                return _result(_custom_id_of(line), error=error)
            async with slots:
                response = await client.post(item["url"], json=item["body"])
            body = response.json()
            return _result(
                item["custom_id"],
                response={
                    "status_code": response.status_code,
                    "request_id": body.get("id") or f"batch-{uuid.uuid4().hex}",
                    "body": body,
                },
            )
        except Exception as exc:  # the route failed outright: this line's error, not the batch's
            error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
            return _result(_custom_id_of(line), error=error)
        finally:
            progress.update(1)

    return await asyncio.gather(*(run(line) for line in lines))


async def run_batch(engine_args: EngineArgs, input_path: str, output_path: str) -> int:
    """Run every line of ``input_path`` and write ``output_path``; the number of failed lines."""
    from ember_server.engine.async_llm import AsyncLLM
    from ember_server.openai.api_server import build_app

    with open(input_path, encoding="utf-8") as file:
        lines = [line for line in file.read().splitlines() if line.strip()]
    engine = await AsyncLLM.start(engine_args)
    try:
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://ember-batch", timeout=None
        ) as client:
            with tqdm(total=len(lines), desc="Processed requests", dynamic_ncols=True) as bar:
                results = await run_lines(client, lines, bar)
    finally:
        await engine.shutdown()
    with open(output_path, "w", encoding="utf-8") as file:
        for result in results:
            file.write(json.dumps(result) + "\n")
    return sum(1 for r in results if r["error"] is not None or r["response"]["status_code"] != 200)
