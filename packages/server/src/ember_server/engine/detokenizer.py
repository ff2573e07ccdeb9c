"""Incremental detokenization of one sequence, with stop strings.

Text is produced by the tokenizer's Rust ``DecodeStream``, which holds back tokens until they
complete a UTF-8 character, so a character split across tokens never streams as U+FFFD. Stop
strings are searched only in the region the new text could complete; when they are to be left
out of the output, the last ``max(len(stop)) - 1`` characters are held back from streamed deltas
until it is known that they do not start a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from ember_scheduler.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so that a decoder whose output depends on the previous
# token (SentencePiece's leading-space rule) renders the first generated token as it would in context.
_PROMPT_CONTEXT_TOKENS = 6


def backend_tokenizer(tokenizer):
    """The Rust ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no fast (Rust) backend; Ember needs a fast "
            "tokenizer (tokenizer.json) for incremental detokenization"
        )
    return backend


class IncrementalDetokenizer:
    """Builds one sequence's output text as its tokens arrive and reports a matched stop string."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._fed_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])  # context, then outputs
        self._num_rendered = len(self._fed_ids)  # fed ids whose text is in output_text
        self._stream = DecodeStream(
            ids=list(self._fed_ids), skip_special_tokens=self._skip_special_tokens
        )
        self._stopped_by_string = False
        self._flushed = False
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.token_ids: list[int] = []
        self.output_text = ""
        self._sent_offset = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens and their text; return the stop string that now ends the text, if any.

        ``stop_terminated``: the engine ended the sequence on its last token (EOS or a stop token
        id); that token's text is left out unless ``include_stop_str_in_output``.
        """
        if not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        num_chars_before = len(self.output_text)
        if to_decode:
            self._fed_ids.extend(to_decode)
            chunk = self._stream.step(self._backend, to_decode)
            if chunk is not None:
                self.output_text += chunk
                self._num_rendered = len(self._fed_ids)
        num_new_chars = len(self.output_text) - num_chars_before
        if not self.stop or num_new_chars == 0 or len(self.token_ids) <= self.min_tokens:
            return None
        return self._truncate_at_stop_string(num_new_chars)

    def _truncate_at_stop_string(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string touching the new text; cut the text there."""
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = text[:end]
        self._stopped_by_string = True
        return stop

    def _flush(self) -> None:
        """At the end, render tokens still held back as an incomplete character (as U+FFFD,
        the way a one-shot ``decode`` of the whole output renders them)."""
        self._flushed = True
        pending = self._fed_ids[self._num_rendered :]
        if not pending or self._stopped_by_string:
            return
        start = max(0, self._num_rendered - _PROMPT_CONTEXT_TOKENS)
        context = self._fed_ids[start : self._num_rendered]
        skip = self._skip_special_tokens
        with_pending = self._backend.decode(context + pending, skip_special_tokens=skip)
        base = self._backend.decode(context, skip_special_tokens=skip)
        self.output_text += with_pending[len(base) :]

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it, or only what is new since the last delta.

        Until the sequence finishes, the stop-string buffer at the end is withheld.
        """
        if finished and not self._flushed:
            self._flush()
        length = len(self.output_text)
        if not finished:
            length -= self.stop_buffer_length
        if not delta:
            return self.output_text[:length]
        if length <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset : length]
        self._sent_offset = length
        return text
