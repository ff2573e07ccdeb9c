"""One streamed chat choice: its text deltas as ``DeltaMessage`` pieces, the model's thinking
split off first (``reasoning.ReasoningStream``), then calls parsed out of the answer (a tool-call
stream of ``tool_calls``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from ember_server.engine.outputs import CompletionOutput, RequestOutput
from ember_server.openai.protocol_chat import DeltaMessage
from ember_server.openai.reasoning import ReasoningStream


class ChoiceStream:
    """The deltas of one choice; either part may be None (its text is then content as it is)."""

    def __init__(self, reasoning: ReasoningStream | None, calls) -> None:
        self.reasoning = reasoning
        self.calls = calls

    def pieces(
        self, output: CompletionOutput, wants_logprobs: bool
    ) -> list[tuple[DeltaMessage, str | None]]:
        """The deltas (and finish reasons) one output becomes; the last carries the finish
        reason. A logprobs-bearing output always gives at least one piece to carry them."""
        text, finish_reason = output.text, output.finish_reason
        pieces: list[tuple[DeltaMessage, str | None]] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if finish_reason is not None:
                more_thought, more_text = self.reasoning.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:
                pieces.append((DeltaMessage(reasoning_content=thought), None))
        if self.calls is None:
            if text or finish_reason is not None or (wants_logprobs and not pieces):
                pieces.append((DeltaMessage(content=text), finish_reason))
            return pieces
        message = self.calls.feed(text)
        if message is not None or (wants_logprobs and not pieces):
            pieces.append((message or DeltaMessage(), None))
        if finish_reason is not None:
            tail, finish_reason = self.calls.finish(finish_reason)
            pieces.append((tail or DeltaMessage(), finish_reason))
        return pieces


@dataclass
class StreamTotals:
    """What a one-choice stream has counted so far (for its usage block)."""

    output_tokens: int = 0
    cached_tokens: int = 0


async def one_choice_pieces(
    choice: ChoiceStream, outputs: AsyncIterator[RequestOutput], totals: StreamTotals
) -> AsyncIterator[tuple[DeltaMessage | None, CompletionOutput | None, str | None]]:
    """Walk a one-choice stream for the routes that shape their own events (Anthropic messages,
    Responses): each piece as ``(piece, None, None)``; when the choice finishes, ``(None,
    output, finish_reason)`` once. ``totals`` is kept current for the usage blocks."""
    async for delta in outputs:
        totals.cached_tokens = delta.num_cached_tokens
        for output in delta.outputs:
            totals.output_tokens += len(output.token_ids)
            finish_reason = output.finish_reason
            for piece, reason in choice.pieces(output, False):
                yield piece, None, None
                finish_reason = reason or finish_reason
            if output.finish_reason is not None:
                yield None, output, finish_reason
