"""Requests that wait for their structured-output grammar, outside the waiting queue.

A request whose ``SamplingParams.structured_outputs`` is set asks the engine core's
``GrammarCompiler`` for a future when it is added and waits in ``WAITING_FOR_FSM`` while others
keep running. Each poll hands the scheduler the requests whose grammar is ready (to queue) and
those whose grammar failed to compile (to finish as aborted, with the reason). The scheduler
never sees a mask or a matcher: those live with the worker's sampler.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.structured_outputs import GrammarCompiler

_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM


class GrammarWaiting:
    """The requests of one scheduler whose grammar is compiling, in the order they came."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def check_supported(self, request: Request) -> None:
        """Refuse a request with structured outputs when there is no compiler for them."""
        if request.sampling_params.structured_outputs is not None and self.compiler is None:
            raise ValueError(
                f"request {request.request_id!r} has structured_outputs, but this engine core has "
                "no grammar compiler"
            )

    def start(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits here until the grammar is ready."""
        request.grammar = self.compiler.compile(request.sampling_params.structured_outputs)
        request.set_status(_WAITING_FOR_FSM)
        self.requests.append(request)

    def poll(self, timeout: float = 0.0) -> tuple[list[Request], list[Request]]:
        """The requests whose grammar is compiled (now WAITING), and those whose grammar failed
        (now FINISHED_ABORTED, the error in ``finish_detail``), waiting up to ``timeout``
        seconds for the first."""
        compiling = self.requests
        if not compiling:
            return [], []
        if timeout > 0:
            wait_futures([r.grammar for r in compiling], timeout, FIRST_COMPLETED)
        still_compiling, ready, failed = [], [], []
        for request in compiling:
            if not request.grammar.done():
                still_compiling.append(request)
                continue
            error = request.grammar.exception()
            request.grammar = None
            if error is None:
                request.set_status(RequestStatus.WAITING)
                ready.append(request)
                continue
            request.set_status(RequestStatus.FINISHED_ABORTED)
            request.finish_detail = str(error)
            failed.append(request)
        self.requests = still_compiling
        return ready, failed

    def drop_finished(self) -> None:
        """Forget requests finished from outside while their grammar compiled."""
        self.requests = [r for r in self.requests if r.status == _WAITING_FOR_FSM]
