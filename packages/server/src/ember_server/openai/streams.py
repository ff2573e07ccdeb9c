"""Async plumbing of the routes: merging per-prompt streams and watching for client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Generic, TypeVar

from starlette.requests import Request

T = TypeVar("T")

_DONE = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


class StartedStream(Generic[T]):
    """An async generator whose first item is requested at once, in a task of its own.

    For an engine stream that sends its request when first iterated, the request reaches the
    engine core while the route is still building its response: sending the response headers
    first woke the HTTP client, which then shared the cores with the engine's step and delayed a
    cached prompt's first token (the server README has the figures).
    Later items are awaited directly by the iterating task. ``aclose`` closes the generator; one
    dropped unclosed is closed by asyncio's finalizer of started async generators, as any.
    """

    def __init__(self, generator: AsyncGenerator[T, None]) -> None:
        self._generator = generator
        self._first: asyncio.Task | None = asyncio.ensure_future(self._first_item())
        self._first.add_done_callback(_retrieve_exception)

    async def _first_item(self) -> T | object:
        try:
            return await self._generator.__anext__()
        except StopAsyncIteration:  # a coroutine may not raise it
            return _DONE

    def __aiter__(self) -> StartedStream[T]:
        return self

    async def __anext__(self) -> T:
        first, self._first = self._first, None
        if first is None:
            return await self._generator.__anext__()
        item = await first  # cancelling the caller cancels the task, and the generator with it
        if item is _DONE:
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    async def aclose(self) -> None:
        first, self._first = self._first, None
        if first is not None:
            first.cancel()
            await asyncio.wait({first})
        await self._generator.aclose()


def _retrieve_exception(task: asyncio.Task) -> None:
    """Mark a first item's failure as seen: a stream closed (or dropped) unread is not an error
    to log; a reader gets the exception from the task."""
    if not task.cancelled():
        task.exception()


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
