"""One request's outputs on their way from the output handler to the caller streaming them."""

from __future__ import annotations

import asyncio

from ember_server.engine.outputs import RequestOutput, RequestOutputKind
from ember_server.engine.pooling_outputs import PoolingRequestOutput

Item = RequestOutput | PoolingRequestOutput | BaseException


class RequestOutputCollector:
    """Holds at most one output for its consumer; a producer that runs ahead is folded in.

    When a new output arrives before the caller took the last one, a ``DELTA`` output is merged
    into the waiting one (text, token ids and logprobs appended per sequence) and any other kind
    replaces it (it already holds everything so far). A slow stream thus catches up in one
    message instead of one per engine step, and nothing queues up behind it. An exception is
    kept over any output and raised by ``get``.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._item: Item | None = None
        self._ready = asyncio.Event()

    def put(self, item: Item) -> None:
        waiting = self._item
        if waiting is None or isinstance(item, BaseException):
            self._item = item
            self._ready.set()
        elif isinstance(waiting, BaseException):
            return  # the consumer is about to fail; later outputs do not matter
        elif self.output_kind == RequestOutputKind.DELTA and isinstance(item, RequestOutput):
            _merge_delta(waiting, item)
        else:
            self._item = item

    def get_nowait(self) -> RequestOutput | PoolingRequestOutput | None:
        """The waiting output, if any (raising a waiting exception)."""
        item = self._item
        if item is None:
            return None
        self._item = None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> RequestOutput | PoolingRequestOutput:
        """Wait for the next output (raising a waiting exception)."""
        while self._item is None:
            await self._ready.wait()
        return self.get_nowait()


def _merge_delta(waiting: RequestOutput, new: RequestOutput) -> None:
    """Append ``new``'s deltas to ``waiting`` (both owned by the collector), sequence by index."""
    by_index = {completion.index: completion for completion in waiting.outputs}
    for completion in new.outputs:
        into = by_index.get(completion.index)
        if into is None:
            waiting.outputs.append(completion)
            by_index[completion.index] = completion
            continue
        into.text += completion.text
        into.token_ids.extend(completion.token_ids)
        if into.logprobs is not None and completion.logprobs is not None:
            into.logprobs.extend(completion.logprobs)
        into.cumulative_logprob = completion.cumulative_logprob
        into.finish_reason = completion.finish_reason
        into.stop_reason = completion.stop_reason
    if waiting.prompt_logprobs is None:
        waiting.prompt_logprobs = new.prompt_logprobs
    waiting.finished = new.finished
    waiting.num_cached_tokens = new.num_cached_tokens
