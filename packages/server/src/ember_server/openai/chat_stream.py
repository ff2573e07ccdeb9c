"""One streamed chat choice: its text deltas as ``DeltaMessage`` pieces, the model's thinking
split off first (``reasoning.ReasoningStream``), then calls parsed out of the answer (a tool-call
stream of ``tool_calls``)."""

from __future__ import annotations

from ember_server.engine.outputs import CompletionOutput
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
