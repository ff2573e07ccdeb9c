"""Async plumbing of the routes: merged prompt streams, and the benchmark's statistics."""

from __future__ import annotations

import asyncio
import math

import pytest

from ember_server.bench.common import percentiles_ms, random_prompts
from ember_server.openai.streams import merge_async_iterators


async def _ticks(name: str, count: int, delay: float, closed: list[str]):
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        closed.append(name)


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
