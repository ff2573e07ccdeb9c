"""The engine core's grammar compiler when the ranks run in other processes: it compiles nothing.

Grammars are compiled where their matchers are used, by the ranks that sample (every
tensor-parallel rank of the last pipeline stage), each in its own ``XGrammarCompiler``. The
engine core only needs to know when a request's grammar is ready, or why it failed:
``RankGrammarCompiler.compile`` hands the spec to the ranks (which start compiling it at once,
off their step loop, and keep the result in their cache for the request's matcher) and returns
a future that the output rank's report resolves. So the engine process builds no compiler (no
tokenizer info, no second compile), and the scheduler's wait is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_worker.structured_outputs import FutureCache


class RankGrammarCompiler:
    """Implements ``ember_scheduler.structured_outputs.GrammarCompiler`` for ranks elsewhere.

    ``send(key)`` asks the ranks to compile the spec whose ``cache_key()`` is ``key`` (the
    spec's msgpack bytes); ``resolve(key, error)`` is called with the output rank's answer
    (``error`` None when the grammar compiled). A future's value is None: the compiled grammar
    stays with the ranks. The futures are cached by spec, ``cache_size`` of them, least
    recently used first out, as the ranks' compilers cache theirs.
    """

    def __init__(self, send: Callable[[bytes], None], cache_size: int = 1024) -> None:
        self._send = send
        self._cache = FutureCache(cache_size)
        self._pending: dict[bytes, Future] = {}  # asked, not answered (evicted or not)

    def compile(self, spec: StructuredOutputsParams) -> Future:
        key = spec.cache_key()
        with self._cache.lock:
            future = self._cache.get(key)
            if future is not None:
                return future
            future = self._pending.get(key)
            ask = future is None
            if ask:
                future = self._pending[key] = Future()
            self._cache.put(key, future)
        if ask:
            self._send(key)
        return future

    def resolve(self, key: bytes, error: str | None) -> None:
        """The output rank's answer for the spec ``key``: compiled, or the reason it is not."""
        with self._cache.lock:
            future = self._pending.pop(key, None)
        if future is None:
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(ValueError(error))

    def shutdown(self) -> None:
        """Fail the compiles still waiting for an answer (the ranks are gone)."""
        with self._cache.lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            future.set_exception(RuntimeError("the executor shut down before the grammar compiled"))


def compile_report(future: Future) -> str | None:
    """What a rank reports of its finished compile: None, or the error's message."""
    if future.cancelled():
        return "the grammar compile was cancelled"
    error = future.exception()
    return None if error is None else str(error) or type(error).__name__
