"""Engine logprobs (one ``{token_id: Logprob}`` per token) in the two OpenAI layouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ember_server.engine.outputs import Logprob
from ember_server.openai.protocol_chat import (
    ChatCompletionLogProbs,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from ember_server.openai.protocol_completion import CompletionLogProbs

TokenText = Callable[[int], str]


def _text(token_id: int, entry: Logprob, token_text: TokenText) -> str:
    return entry.decoded_token if entry.decoded_token is not None else token_text(token_id)


def _top(step: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely entries of one step, most likely first."""
    ranked = sorted(step.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
    return ranked[:num_top]


def completion_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob]],
    num_top: int,
    text_offset: int,
    token_text: TokenText,
) -> tuple[CompletionLogProbs, int]:
    """The legacy completions layout; returns it and the text offset after the last token.

    As vLLM does, each ``top_logprobs`` entry holds the ``num_top`` most likely tokens plus the
    chosen one.
    """
    result = CompletionLogProbs()
    for token_id, step in zip(token_ids, steps):
        chosen = step[token_id]
        text = _text(token_id, chosen, token_text)
        result.tokens.append(text)
        result.token_logprobs.append(max(chosen.logprob, -9999.0))
        result.text_offset.append(text_offset)
        text_offset += len(text)
        top = {_text(t, lp, token_text): max(lp.logprob, -9999.0) for t, lp in _top(step, num_top)}
        top.setdefault(text, max(chosen.logprob, -9999.0))
        result.top_logprobs.append(top)
    return result, text_offset


def chat_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob]],
    num_top: int,
    token_text: TokenText,
) -> ChatCompletionLogProbs:
    """The chat layout: per token its text, logprob, UTF-8 bytes and ``num_top`` alternatives."""
    content = []
    for token_id, step in zip(token_ids, steps):
        chosen = step[token_id]
        text = _text(token_id, chosen, token_text)
        alternatives = [
            ChatTopLogprob(
                token=_text(t, lp, token_text),
                logprob=max(lp.logprob, -9999.0),
                bytes=list(_text(t, lp, token_text).encode()),
            )
            for t, lp in _top(step, num_top)
        ]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=max(chosen.logprob, -9999.0),
                bytes=list(text.encode()),
                top_logprobs=alternatives,
            )
        )
    return ChatCompletionLogProbs(content=content)
