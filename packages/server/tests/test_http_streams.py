"""Async plumbing of the routes: merged prompt streams, and the benchmark's statistics."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest

from ember_server.cli.bench.common import percentiles_ms, random_prompts
from ember_server.openai.streams import StartedStream, merge_async_iterators


async def _ticks(name: str, count: int, delay: float, closed: list[str]):
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        closed.append(name)


async def _recording(events: list[str], items: list[str], fail: bool = False):
    """A stand-in for an engine stream: it sends its request when first iterated."""
    events.append("sent")
    try:
        for item in items:
            await asyncio.sleep(0.001)
            yield item
        if fail:
            raise ValueError("engine refused it")
    finally:
        events.append("closed")


def test_a_started_stream_sends_before_anyone_iterates_and_yields_everything():
    async def run():
        events: list[str] = []
        stream = StartedStream(_recording(events, ["a", "b", "c"]))
        await asyncio.sleep(0)  # the caller does other work: the request goes out meanwhile
        sent_early = list(events)
        return sent_early, [item async for item in stream], events

    sent_early, items, events = asyncio.run(run())
    assert sent_early == ["sent"]
    assert items == ["a", "b", "c"]
    assert events == ["sent", "closed"]


def test_closing_a_started_stream_withdraws_it_at_any_point():
    async def run(wait_s: float | None):
        events: list[str] = []
        stream = StartedStream(_recording(events, ["a", "b"]))
        if wait_s is not None:
            await asyncio.sleep(wait_s)  # the first item is pending (0) or ready (0.01)
        await stream.aclose()
        return events

    assert asyncio.run(run(None)) == []  # closed before its task ran: nothing was sent
    assert asyncio.run(run(0)) == ["sent", "closed"]
    assert asyncio.run(run(0.01)) == ["sent", "closed"]


def test_a_started_streams_failures_and_end_reach_its_reader():
    async def run(items: list[str], fail: bool):
        events: list[str] = []
        got = []
        with (
            pytest.raises(ValueError, match="engine refused") if fail else contextlib.nullcontext()
        ):
            async for item in StartedStream(_recording(events, items, fail)):
                got.append(item)
        return got, events

    assert asyncio.run(run([], fail=True)) == ([], ["sent", "closed"])
    assert asyncio.run(run(["a"], fail=True)) == (["a"], ["sent", "closed"])
    assert asyncio.run(run([], fail=False)) == ([], ["sent", "closed"])


def test_cancelling_the_reader_of_a_started_stream_closes_it():
    async def run():
        events: list[str] = []
        stream = StartedStream(_recording(events, ["a"] * 1000))
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await asyncio.sleep(0)
        return events

    assert asyncio.run(run()) == ["sent", "closed"]


def test_merge_yields_every_item_with_its_source():
    async def run():
        closed: list[str] = []
        merged = merge_async_iterators(
            _ticks("a", 3, 0.001, closed), _ticks("b", 2, 0.0015, closed)
        )
        return [item async for item in merged], closed

    items, closed = asyncio.run(run())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert [i for _, i in items if i.startswith("a")] == ["a0", "a1", "a2"]
    assert sorted(closed) == ["a", "b"]


def test_merge_raises_the_first_failure_and_cancels_the_rest():
    async def failing():
        await asyncio.sleep(0.001)
        raise ValueError("bad prompt")
        yield  # pragma: no cover - makes this an async generator

    async def run():
        closed: list[str] = []
        with pytest.raises(ValueError, match="bad prompt"):
            async for _ in merge_async_iterators(_ticks("slow", 100, 0.01, closed), failing()):
                pass
        await asyncio.sleep(0.02)
        return closed

    assert asyncio.run(run()) == ["slow"]


def test_closing_the_merge_cancels_its_sources():
    async def run():
        closed: list[str] = []
        merged = merge_async_iterators(
            _ticks("x", 100, 0.001, closed), _ticks("y", 100, 0.001, closed)
        )
        async for _ in merged:
            break
        await merged.aclose()
        await asyncio.sleep(0.01)
        return closed

    assert sorted(asyncio.run(run())) == ["x", "y"]


def test_percentiles_and_prompts():
    stats = percentiles_ms([0.001, 0.002, 0.003])
    assert stats["p50_ms"] == pytest.approx(2.0) and stats["mean_ms"] == pytest.approx(2.0)
    assert math.isnan(percentiles_ms([])["p99_ms"])
    prompts = random_prompts(3, 5, 100, seed=1)
    assert len(prompts) == 3 and all(len(p) == 5 and min(p) >= 16 and max(p) < 100 for p in prompts)
    assert prompts == random_prompts(3, 5, 100, seed=1)
    with pytest.raises(ValueError, match="vocab_size"):
        random_prompts(1, 1, 10)
