"""Admission control of the serving front end: a bounded waiting queue and per-request deadlines.

A request *waits* from the moment it is sent to an engine core until its first output comes back
(queued in the scheduler, or prefilling). Past ``max_num_waiting_requests`` waiting requests, new
ones are refused with ``EngineOverloadedError`` before anything reaches an engine, so the running
ones keep their latency; the error carries a retry time estimated from how long recent requests
waited. A deadline ends a request with ``RequestTimeoutError``; the request is aborted in its
engine core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import math
import time

# Weight of the newest wait in the running estimate: about the last ten requests count.
_WAIT_SMOOTHING = 0.1


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(RuntimeError):
    """A request passed its deadline before it finished; it was aborted in the engine."""


def check_timeout(timeout: float | None, field: str = "timeout") -> None:
    """A deadline must be a positive number of seconds (or None: no deadline)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"{field} must be a positive number of seconds, got {timeout!r}")


class AdmissionControl:
    """Counts waiting requests against ``max_waiting`` and turns timeouts into deadlines (both
    checked where they are set, ``EngineArgs``)."""

    def __init__(self, max_waiting: int | None = None, default_timeout: float | None = None):
        self.max_waiting = max_waiting
        self.default_timeout = default_timeout
        self._waiting: dict[str, float] = {}  # request id -> when it was sent
        self._mean_wait = 0.0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def check(self) -> None:
        """Raise ``EngineOverloadedError`` when the waiting queue is full."""
        if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
            raise EngineOverloadedError(
                f"The server is overloaded: {len(self._waiting)} requests are waiting to start "
                f"(ember serve --max-num-waiting-requests {self.max_waiting}). Retry later.",
                self.retry_after(),
            )

    def retry_after(self) -> int:
        """Whole seconds a refused client should wait: the recent mean wait, at least 1."""
        return max(1, math.ceil(self._mean_wait))

    def deadline(self, timeout: float | None) -> float | None:
        """The ``time.monotonic()`` by which a request given ``timeout`` must finish."""
        check_timeout(timeout)
        timeout = self.default_timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    def sent(self, request_id: str) -> None:
        self._waiting[request_id] = time.monotonic()

    def started(self, request_id: str) -> None:
        """The request's first output came back: it no longer waits."""
        sent_at = self._waiting.pop(request_id, None)
        if sent_at is not None:
            wait = time.monotonic() - sent_at
            self._mean_wait += _WAIT_SMOOTHING * (wait - self._mean_wait)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed) before or after it started."""
        self._waiting.pop(request_id, None)


async def next_before(deadline: float | None, queue, request_id: str):
    """``queue``'s next item, or ``RequestTimeoutError`` once ``deadline`` passes."""
    if deadline is None:
        return await queue.get()
    try:
        async with asyncio.timeout_at(deadline):  # the event loop's clock is time.monotonic()
            return await queue.get()
    except TimeoutError:
        raise RequestTimeoutError(
            f"request {request_id!r} passed its deadline and was aborted"
        ) from None
