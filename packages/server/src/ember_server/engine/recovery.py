"""Recovery from a dead engine core: restart it, and move its requests to a live one.

An engine core dies when its process crashes or is killed, when a step fails, or when a rank of
its TP/PP group dies (the group's executor takes its engine core down with it). The front end then

- restarts it with the same arguments (the compiled-kernel cache is warm by now) after a
  back-off, at most ``max_engine_restarts`` times in ``RESTART_WINDOW`` seconds; past that the
  engine stays dead, and once no engine is left the server fails as a fail-stop one would (every
  request ends with an error and ``ember serve`` exits 1);
- resubmits each unfinished request as a continuation (``OutputProcessor.continuations``: the
  prompt, the tokens already delivered, the same parameters and seed) to a live engine core, or to
  the restarted one once it is ready. Greedy and seeded sampling depend only on the request's own
  tokens, so the continuation produces what the undisturbed request would have. A request moved
  more than ``MAX_MIGRATIONS`` times fails with a clear error: it may be what kills the engines.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

from ember_scheduler.engine_types import SchedulerStats
from ember_server.engine.core_client import AsyncMPClient, EngineDeadError
from ember_server.engine.engine_args import RESTART_WINDOW

if TYPE_CHECKING:
    from ember_server.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

MAX_MIGRATIONS = 3
# Seconds before the n-th restart within the window (the last repeats).
RESTART_BACKOFF = (0.0, 1.0, 4.0, 10.0)


class RestartBudget:
    """Restarts of one engine allowed in a sliding window, and the back-off before each."""

    def __init__(self, max_restarts: int, window: float = RESTART_WINDOW, clock=time.monotonic):
        self.max_restarts = max_restarts
        self.window = window
        self._clock = clock
        self._recent: collections.deque[float] = collections.deque()

    def take(self) -> float | None:
        """The delay before the next restart, or None when the budget is spent."""
        now = self._clock()
        while self._recent and now - self._recent[0] > self.window:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return None
        self._recent.append(now)
        return RESTART_BACKOFF[min(len(self._recent), len(RESTART_BACKOFF)) - 1]


class EngineRecovery:
    """Restarts ``llm``'s dead engine cores and moves their requests (see the module doc)."""

    def __init__(self, llm: AsyncLLM, max_restarts: int, lockstep: bool = False) -> None:
        self.llm = llm
        # Lock-step engine cores (``lockstep``) are one expert-parallel group: one gone, the
        # group is, and a restarted engine could not rejoin it; everything fails at once.
        self.lockstep = lockstep
        self.budgets = [RestartBudget(max_restarts) for _ in llm.clients]
        self.num_restarts = 0
        self._restarting: set[int] = set()
        self._parked: list[str] = []  # requests waiting for an engine to come back
        self._engine_alive = asyncio.Event()
        self._engine_alive.set()
        self._tasks: set[asyncio.Task] = set()

    def engine_died(self, index: int, reason: str) -> None:
        """Engine ``index`` is dead: stop routing to it and reading it, then restart it and move
        its requests on, or (nothing can come back) fail them; with no engine left and none
        coming back, fail everything."""
        llm = self.llm
        if llm.engine_errors[index] is not None:
            return
        if len(llm.clients) > 1:
            reason = f"engine core {index} is dead: {reason}"
        error = EngineDeadError(reason)
        llm.engine_errors[index] = error
        llm.router.mark_dead(index)
        llm.metrics.record_engine_alive(index, False)
        request_ids = llm.router.requests_on(index)
        task = llm.output_tasks[index]
        if not task.done() and task is not asyncio.current_task():
            task.cancel()
        if self.lockstep:
            logger.error("engine core %d of the lock-step group is dead: %s", index, reason)
            llm.give_up(error)
            return
        if self.take_over(index, request_ids):
            logger.error(
                "engine core %d is dead, moving its %d requests on: %s",
                index,
                len(request_ids),
                reason,
            )
            return
        logger.error(
            "engine core %d is dead, failing %d requests: %s", index, len(request_ids), reason
        )
        # Their state goes with them; nothing is sent to the dead engine.
        for request_id in request_ids:
            llm.fail_request(request_id, error)
        if not self._any_alive():
            llm.give_up(error)

    def take_over(self, index: int, request_ids: list[str]) -> bool:
        """Engine ``index`` was just marked dead holding ``request_ids``: restart it if the
        budget allows and move its requests. False when nothing can come back (no engine alive
        and none restarting): the caller fails the requests."""
        delay = self.budgets[index].take()
        if delay is not None:
            self._restarting.add(index)
            self._spawn(self._restart(index, delay))
        if not self._any_alive():
            self._engine_alive.clear()
            if not self._restarting:
                return False
        for request_id in request_ids:
            self.llm.router.finish(request_id)
        self._spawn(self._move(request_ids))
        return True

    async def wait_for_engine(self) -> None:
        """Return once some engine core is alive; raise the engine's error if none will be."""
        if not self._engine_alive.is_set():
            waits = [
                asyncio.ensure_future(self._engine_alive.wait()),
                asyncio.ensure_future(self.llm.wait_until_dead()),
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if self.llm.dead_error is not None:
            raise self.llm.dead_error

    def _any_alive(self) -> bool:
        return any(error is None for error in self.llm.engine_errors)

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _move(self, request_ids: list[str]) -> None:
        if not self._any_alive():
            self._parked.extend(request_ids)
            return
        for request_id in request_ids:
            await self._resubmit(request_id)

    async def _resubmit(self, request_id: str) -> None:
        llm = self.llm
        requests = llm.output_processor.continuations(request_id)
        if not requests:  # it finished or was aborted meanwhile
            return
        parent = llm.output_processor.parent_requests.get(request_id)
        if parent is not None and parent.num_migrations > MAX_MIGRATIONS:
            llm.fail_request(
                request_id,
                EngineDeadError(
                    f"request {request_id!r} was moved to another engine core "
                    f"{MAX_MIGRATIONS} times and its engine died again; it is not retried"
                ),
            )
            return
        if not self._any_alive():
            self._parked.append(request_id)
            return
        decision = llm.route(request_id, requests)
        llm.metrics.record_route(decision.engine, "migrated")
        # A send to an engine that has just died leaves the request routed there: that engine's
        # death moves it again.
        with contextlib.suppress(EngineDeadError):
            await llm.clients[decision.engine].add_requests(requests)

    async def _restart(self, index: int, delay: float) -> None:
        llm = self.llm
        await asyncio.sleep(delay)
        old = llm.clients[index]
        await old.shutdown(timeout=0.0)  # a failed step may have left the process running
        logger.warning("restarting engine core %d (restart %d)", index, self.num_restarts + 1)
        client = AsyncMPClient.launch(llm.engine_args)
        try:
            await client.wait_ready(functools.partial(llm.on_engine_exit, index))
        except Exception as exc:  # it could not start: another death of the same engine
            self._restarting.discard(index)
            logger.error("engine core %d did not restart: %s", index, exc)
            llm.clients[index] = client
            if not self.take_over(index, []):
                llm.give_up(EngineDeadError(f"engine core {index} could not restart: {exc}"))
            return
        self.num_restarts += 1
        self._restarting.discard(index)
        llm.clients[index] = client
        llm.engine_errors[index] = None
        llm.engine_stats[index] = SchedulerStats()
        llm.router.mark_alive(index)
        llm.metrics.record_engine_alive(index, True)
        llm.metrics.record_engine_restart(index)
        llm.output_tasks[index] = asyncio.ensure_future(llm.run_output_handler(index))
        logger.warning("engine core %d is back (pid %d)", index, client.pid)
        self._engine_alive.set()
        parked, self._parked = self._parked, []
        for request_id in parked:
            await self._resubmit(request_id)
