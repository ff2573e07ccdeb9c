"""Async plumbing of the routes: merging per-prompt streams and watching for client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

_DONE = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Items of all ``iterators`` as ``(iterator index, item)``, in arrival order.

    The first failure of any iterator is raised; closing the merged iterator cancels the rest.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, _DONE))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(work: Awaitable[T], request: Request) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let its cleanup (aborting engine requests) run
    raise ClientDisconnected()
