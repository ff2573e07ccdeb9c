"""Turning the engine's logprob rows into vLLM's per-token ``{token_id: Logprob}`` dicts."""

from __future__ import annotations

from ember_scheduler.outputs import Logprobs
from ember_server.engine.outputs import Logprob, PromptLogprobs, SampleLogprobs


class LogprobsDecoder:
    """Builds logprob dicts with each token's text, decoding the vocabulary once on first use."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_texts: list[str] | None = None

    def _texts(self) -> list[str]:
        if self._token_texts is None:
            size = len(self._tokenizer)
            self._token_texts = self._tokenizer.batch_decode(
                [[i] for i in range(size)], skip_special_tokens=False
            )
        return self._token_texts

    def token_text(self, token_id: int) -> str:
        texts = self._texts()
        return texts[token_id] if 0 <= token_id < len(texts) else ""

    def sample_logprobs(self, rows: Logprobs) -> tuple[SampleLogprobs, float]:
        """One dict per row and the sum of the chosen tokens' logprobs.

        Each dict holds the chosen token first (with its rank), then the top alternatives ranked
        1..N.
        """
        texts = self._texts()
        num_texts = len(texts)
        result: SampleLogprobs = []
        total = 0.0
        for ids, values, chosen_rank in zip(rows.token_ids, rows.logprobs, rows.ranks):
            chosen = ids[0]
            entry = {
                chosen: Logprob(values[0], chosen_rank, texts[chosen] if chosen < num_texts else "")
            }
            for rank, (token_id, value) in enumerate(zip(ids[1:], values[1:]), start=1):
                if token_id not in entry:
                    text = texts[token_id] if token_id < num_texts else ""
                    entry[token_id] = Logprob(value, rank, text)
            result.append(entry)
            total += values[0]
        return result, total

    def prompt_logprobs(self, rows: Logprobs) -> PromptLogprobs:
        """``[None]`` for the first prompt token, then one dict per following prompt token."""
        entries, _ = self.sample_logprobs(rows)
        return [None, *entries]
