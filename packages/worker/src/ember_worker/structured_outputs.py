"""Structured outputs with xgrammar: grammars compiled off the hot path, masks on the logits.

``XGrammarCompiler`` implements the scheduler's ``GrammarCompiler``: it builds xgrammar's
tokenizer info once per model (in its thread pool, while the model loads) and compiles specs in
that pool, caching the futures by spec. ``GrammarMatchers`` keeps one matcher per constrained
request of the model runner's batch: per step it fills the token bitmask of the constrained rows
only, applies it to those rows' logits in one call, and advances the matchers on the sampled
tokens. With speculative decoding, ``apply_bitmask_with_drafts`` masks every verified position of
a drafted row by advancing its matcher through the drafts and rolling it back, and
``cut_drafts`` cuts proposed drafts at the first token the grammar refuses.

A matcher's end tokens are the request's EOS and stop token ids: the mask allows them only where
the grammar may end, and allows nothing else once it must end, so a grammar that reaches its end
state finishes the request with ``stop``; one that cannot finish within ``max_tokens`` finishes
with ``length`` (its output is then cut short, and may not parse).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from ember_scheduler.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Longest run of whitespace JSON may hold between its tokens, unless whitespace is disabled
# altogether: enough for indented JSON, and a bound that keeps a model from wandering.
MAX_JSON_WHITESPACE = 16
_FIELD = "SamplingParams.structured_outputs"
# xgrammar's messages start with "[time] file.cc:line: " and sometimes a failed-check preamble.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")
# xgrammar 0.2.8 writes a string with minLength/maxLength as a run of this class, which lets raw
# control characters (invalid in JSON) through; JSON strings exclude all of \0-\x1f.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def grammar_of(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar grammar of a spec; ValueError naming the field when it does not parse."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else {"type": "object"}
            flexible = not spec.disable_any_whitespace
            grammar = xgr.Grammar.from_json_schema(
                schema if isinstance(schema, str) else json.dumps(schema),
                any_whitespace=flexible,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if flexible else None,
            )
            text = str(grammar)
            if _LOOSE_STRING_CHAR not in text:
                return grammar
            return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {choices}")
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
        raise ValueError(f"{_FIELD}.{kind} is invalid: {message}") from None


def check_structured_outputs(spec: StructuredOutputsParams | None) -> None:
    """Raise ValueError naming the field when ``spec`` cannot become a grammar (no tokenizer
    needed: front ends call this before admitting a request)."""
    if spec is not None:
        grammar_of(spec)


class XGrammarCompiler:
    """Compiles structured-output specs for one model in a thread pool; implements
    ``ember_scheduler.structured_outputs.GrammarCompiler``.

    ``tokenizer`` is the Hugging Face tokenizer folder (its tokenizer info is built once, in the
    pool, when the first spec is compiled, as vLLM does: built at start-up it took the engine's
    cores and GIL while it loaded the model, for engines that may never see a constrained
    request); ``vocab_size`` the model's (logit rows may be wider than the tokenizer's
    vocabulary).
    Compiled grammars are cached by spec, ``cache_size`` of them, least recently used first out;
    a spec that fails keeps its error in the cache too.
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike,
        vocab_size: int,
        *,
        max_workers: int = 2,
        cache_size: int = 1024,
    ) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="ember-grammar")
        self._cache = FutureCache(cache_size)
        self._tokenizer = str(tokenizer)
        self._compiler: Future | None = None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        key = spec.cache_key()
        with self._cache.lock:
            future = self._cache.get(key)
            if future is None:
                if self._compiler is None:
                    self._compiler = self._pool.submit(
                        _make_compiler, self._tokenizer, self.vocab_size
                    )
                future = self._cache.put(key, self._pool.submit(self._compile, spec))
            return future

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = grammar_of(spec)
        return self._compiler.result().compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class FutureCache:
    """Compile futures by spec key, the ``size`` most recently used (a grammar compiler's cache;
    ``get`` and ``put`` are called holding ``lock``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self._futures: OrderedDict[bytes, Future] = OrderedDict()

    def get(self, key: bytes) -> Future | None:
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
        return future

    def put(self, key: bytes, future: Future) -> Future:
        self._futures[key] = future
        if len(self._futures) > self.size:
            self._futures.popitem(last=False)
        return future


def _make_compiler(tokenizer_path: str, vocab_size: int) -> xgr.GrammarCompiler:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    # One thread per compile: the pool runs compiles side by side. The cache is ours (by spec).
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class GrammarMatchers:
    """One xgrammar matcher per constrained request of a batch, and the batch's token bitmask
    (one row per logits row: ``1 + num_speculative_tokens`` per request)."""

    def __init__(
        self, compiler: XGrammarCompiler, max_num_reqs: int, num_speculative_tokens: int = 0
    ) -> None:
        self.compiler = compiler
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._num_rows = max_num_reqs * (1 + num_speculative_tokens)
        # Made with the first constrained request: importing xgrammar (which imports
        # transformers) took a second of every engine's start-up.
        self._bitmask: torch.Tensor | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def add_request(
        self,
        req_id: str,
        spec: StructuredOutputsParams,
        end_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """Start a matcher for ``req_id`` (its grammar is compiled, or compiles now), replaying
        the outputs it already has (a request resumed after preemption)."""
        import xgrammar as xgr

        compiled = self.compiler.compile(spec).result()
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self._num_rows, self.compiler.vocab_size)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(end_token_ids) or None)
        for token in output_token_ids:
            if not matcher.accept_token(token):
                raise ValueError(f"request {req_id!r}: output token {token} breaks its grammar")
        self._matchers[req_id] = matcher

    def remove_request(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def apply_bitmask(self, logits: torch.Tensor, req_id_to_index: dict[str, int]) -> None:
        """Mask, in place, the logit rows of the constrained requests (``req_id_to_index`` maps a
        request to its row); other rows are left exactly as they are."""
        # A grammar that has ended masks nothing: its request ended (async scheduling runs it
        # one more step, whose token the scheduler drops).
        live = [(r, m) for r, m in self._matchers.items() if not m.is_terminated()]
        if not live:
            return
        import xgrammar as xgr

        rows = [req_id_to_index[req_id] for req_id, _ in live]
        bitmask = self._bitmask
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, rows)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask[: logits.shape[0]].to(logits.device, non_blocking=True), indices=rows
        )

    def apply_bitmask_with_drafts(
        self,
        logits: torch.Tensor,
        req_id_to_index: dict[str, int],
        first_rows: np.ndarray,
        drafts: dict[str, Sequence[int]],
    ) -> None:
        """Mask, in place, the logit rows of the constrained requests at every verified
        position: ``first_rows[req_id_to_index[req_id]]`` is the row that predicts the
        request's first draft, and the row ``j`` after it gets the mask after its first ``j``
        drafts. The matchers advance through the drafts tentatively and roll back; rows after a
        draft the grammar refuses (or after the grammar's end) are left as they are: that draft
        has probability 0, so it and all after it are rejected."""
        if not self._matchers:
            return
        import xgrammar as xgr

        bitmask = self._bitmask
        rows = []
        for req_id, matcher in self._matchers.items():
            row = int(first_rows[req_id_to_index[req_id]])
            advanced = 0
            for token in (*drafts.get(req_id, ()), None):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, row + advanced)
                rows.append(row + advanced)
                if token is None or not matcher.accept_token(token):
                    break
                advanced += 1
            self.rollback(req_id, advanced)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask[: logits.shape[0]].to(logits.device, non_blocking=True), indices=rows
        )

    def cut_drafts(self, req_id_to_index: dict[str, int], drafts: list[list[int]]) -> None:
        """Cut, in place, each constrained request's proposed drafts (``drafts[row]``) at the
        first token its grammar refuses; the matchers are left as they were."""
        for req_id in self._matchers:
            row = req_id_to_index[req_id]
            accepted = self.accept_tokens(req_id, drafts[row])
            self.rollback(req_id, accepted)
            del drafts[row][accepted:]

    def accept_tokens(self, req_id: str, token_ids: Sequence[int]) -> int:
        """Advance ``req_id``'s matcher over ``token_ids``; returns how many it accepted (it
        stops at the first token its grammar rejects, or once the grammar has ended)."""
        matcher = self._matchers[req_id]
        for count, token in enumerate(token_ids):
            if matcher.is_terminated() or not matcher.accept_token(token):
                return count
        return len(token_ids)

    def accept_sampled(
        self, req_id_to_index: dict[str, int], sampled: Sequence[Sequence[int]]
    ) -> None:
        """Advance the constrained requests' matchers by the tokens they sampled this step
        (``sampled[row]``; empty for a request still in prefill). A matcher whose grammar has
        ended takes nothing: under async scheduling a request that ended runs one more step,
        whose token the scheduler drops."""
        for req_id, matcher in self._matchers.items():
            tokens = sampled[req_id_to_index[req_id]]
            if matcher.is_terminated():
                continue
            accepted = self.accept_tokens(req_id, tokens)
            if accepted < len(tokens):
                logger.warning(
                    "request %r sampled token %d, which its grammar rejects",
                    req_id,
                    tokens[accepted],
                )

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens of ``req_id`` (rejected drafts)."""
        if num_tokens > 0:
            self._matchers[req_id].rollback(num_tokens)
