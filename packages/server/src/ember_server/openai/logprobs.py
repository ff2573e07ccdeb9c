"""Engine logprobs (one ``{token_id: Logprob}`` per token) in the two OpenAI layouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ember_server.engine.outputs import Logprob
from ember_server.openai.protocol_chat import (
    ChatCompletionLogProbs,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from ember_server.openai.protocol_completion import CompletionLogProbs, PromptLogprob

TokenText = Callable[[int], str]


def _text(token_id: int, entry: Logprob | None, token_text: TokenText) -> str:
    if entry is None or entry.decoded_token is None:
        return token_text(token_id)
    return entry.decoded_token


def token_id_text(token_id: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` shows it."""
    return f"token_id:{token_id}"


def _top(step: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely entries of one step, most likely first."""
    ranked = sorted(step.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
    return ranked[:num_top]


def completion_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    token_text: TokenText,
    as_ids: bool = False,
) -> tuple[CompletionLogProbs, int]:
    """The legacy completions layout; returns it and the text offset after the last token.

    As vLLM does, each ``top_logprobs`` entry holds the ``num_top`` most likely tokens plus the
    chosen one. A step that is None (a prompt's first token: nothing precedes it) has None
    logprobs. ``as_ids``: tokens shown as ``token_id:<id>`` (offsets still count their text).
    """
    result = CompletionLogProbs()
    for token_id, step in zip(token_ids, steps):
        chosen = None if step is None else step[token_id]
        text = _text(token_id, chosen, token_text)
        shown = token_id_text(token_id) if as_ids else text
        result.tokens.append(shown)
        result.text_offset.append(text_offset)
        text_offset += len(text)
        if chosen is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(max(chosen.logprob, -9999.0))
        top = {
            token_id_text(t) if as_ids else _text(t, lp, token_text): max(lp.logprob, -9999.0)
            for t, lp in _top(step, num_top)
        }
        top.setdefault(shown, max(chosen.logprob, -9999.0))
        result.top_logprobs.append(top)
    return result, text_offset


def chat_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob]],
    num_top: int,
    token_text: TokenText,
    as_ids: bool = False,
) -> ChatCompletionLogProbs:
    """The chat layout: per token its text, logprob, UTF-8 bytes and ``num_top`` alternatives
    (``as_ids``: tokens shown as ``token_id:<id>``, bytes still those of their text)."""

    def entry(token_id: int, lp: Logprob) -> tuple[str, float, list[int]]:
        text = _text(token_id, lp, token_text)
        shown = token_id_text(token_id) if as_ids else text
        return shown, max(lp.logprob, -9999.0), list(text.encode())

    content = []
    for token_id, step in zip(token_ids, steps):
        token, logprob, data = entry(token_id, step[token_id])
        alternatives = [
            ChatTopLogprob(token=t, logprob=v, bytes=b)
            for t, v, b in (entry(tid, lp) for tid, lp in _top(step, num_top))
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=logprob, bytes=data, top_logprobs=alternatives)
        )
    return ChatCompletionLogProbs(content=content)


def vllm_prompt_logprobs(
    prompt_logprobs: Sequence[dict[int, Logprob] | None], token_text: TokenText
) -> list[dict[str, PromptLogprob] | None]:
    """The engine's prompt logprobs in vLLM's response layout (keyed by token id)."""
    return [
        None
        if step is None
        else {
            str(t): PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=_text(t, lp, token_text)
            )
            for t, lp in step.items()
        }
        for step in prompt_logprobs
    ]
