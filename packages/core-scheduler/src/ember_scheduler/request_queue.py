"""Waiting queues: first come first served, or by priority then arrival."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from ember_scheduler.request import Request


class FCFSRequestQueue:
    """Arrival order; a preempted request goes back to the front (it was admitted earlier)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest ``priority`` value first, then earliest arrival, then insertion order.

    Removal is lazy: a removed request stays in the heap, marked, until it reaches the top.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._removed: set[int] = set()
        self._counter = itertools.count()
        self._entry_of: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        seq = next(self._counter)
        self._entry_of[request.request_id] = seq
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))

    prepend_request = add_request  # a preempted request keeps its place by priority and arrival

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[2])

    def peek_request(self) -> Request:
        self._drop_removed()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def pop_request(self) -> Request:
        self._drop_removed()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        request = heapq.heappop(self._heap)[3]
        del self._entry_of[request.request_id]
        return request

    def remove_request(self, request: Request) -> None:
        seq = self._entry_of.pop(request.request_id, None)
        if seq is None:
            raise ValueError(f"request {request.request_id!r} is not in the queue")
        self._removed.add(seq)

    def __len__(self) -> int:
        return len(self._entry_of)

    def __bool__(self) -> bool:
        return bool(self._entry_of)

    def __iter__(self) -> Iterator[Request]:
        live = (e for e in self._heap if e[2] not in self._removed)
        return (e[3] for e in sorted(live))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue
