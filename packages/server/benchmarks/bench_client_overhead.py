"""What the serving benchmark's HTTP client itself costs: aiohttp (its client, as in vLLM's serving
benchmark) against httpx (its client before), on a canned local server that answers at once.

On the 2-core machines the load generator shares the cores with the server, so client time is
counted in the server's time to first token and competes with it for CPU. For each client it
prints the median time of a streamed completion request with a 1,500-token prompt whose answer is
one chunk (the peer benchmark's TTFT request), and the client CPU per streamed chunk of a
128-chunk answer, each with the ratio httpx / aiohttp.

    python packages/server/benchmarks/bench_client_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import threading
import time

import aiohttp
import httpx

REQUESTS = 40
PROMPT = [random.Random(0).randrange(16, 1000) for _ in range(1500)]


def _chunk(text: str, finish_reason: str | None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    event = b"data: " + json.dumps({"id": "cmpl-1", "choices": [choice]}).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _answer(num_chunks: int) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    chunks = [_chunk("a", None) for _ in range(num_chunks - 1)] + [_chunk("a", "length")]
    done = b"data: [DONE]\n\n"
    return head + b"".join(chunks) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)


def _serve(listener: socket.socket, answer: bytes) -> None:
    """Read each request whole, send ``answer``, close (one request per connection)."""
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(answer)


def start_canned_server(num_chunks: int) -> str:
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(listener, _answer(num_chunks)), daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions"


async def _with_httpx(url: str, body: dict) -> tuple[float, float, int]:
    async with httpx.AsyncClient(timeout=None) as client:
        start, cpu = time.perf_counter(), time.process_time()
        async with client.stream("POST", url, json=body) as response:
            events = [line async for line in response.aiter_lines() if line.startswith("data:")]
        return time.perf_counter() - start, time.process_time() - cpu, len(events)


async def _with_aiohttp(url: str, body: dict) -> tuple[float, float, int]:
    async with aiohttp.ClientSession() as session:
        start, cpu = time.perf_counter(), time.process_time()
        async with session.post(url, json=body) as response:
            events = [line async for line in response.content if line.startswith(b"data:")]
        return time.perf_counter() - start, time.process_time() - cpu, len(events)


def measure(client, url: str, num_chunks: int) -> tuple[float, float]:
    """(median ms from sending a request to its last event, median CPU µs per chunk) over
    REQUESTS requests, each on a fresh connection; CPU is the process's, so it includes the
    canned server thread's, the same for both clients."""
    body = dict(model="m", prompt=PROMPT, max_tokens=num_chunks, stream=True)
    walls, cpus = [], []
    for _ in range(REQUESTS):
        wall, cpu, events = asyncio.run(client(url, body))
        if events != num_chunks + 1:
            raise RuntimeError("the canned stream was not read whole")
        walls.append(wall)
        cpus.append(cpu / num_chunks)
    return 1e3 * statistics.median(walls), 1e6 * statistics.median(cpus)


def main() -> None:
    for num_chunks in (1, 128):
        url = start_canned_server(num_chunks)
        measure(_with_aiohttp, url, num_chunks)  # imports and first-use costs out of the way
        measure(_with_httpx, url, num_chunks)
        old_ms, old_cpu = measure(_with_httpx, url, num_chunks)
        new_ms, new_cpu = measure(_with_aiohttp, url, num_chunks)
        print(
            f"{num_chunks:3d}-chunk stream, 1,500-token prompt: per request httpx {old_ms:.2f} ms, "
            f"aiohttp {new_ms:.2f} ms ({old_ms / new_ms:.1f}x); CPU per chunk httpx "
            f"{old_cpu:.0f} µs, aiohttp {new_cpu:.0f} µs ({old_cpu / new_cpu:.1f}x)"
        )


if __name__ == "__main__":
    main()
