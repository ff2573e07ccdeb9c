"""Prompt text and chat conversations to token ids, the way a server facing the open internet must.

- **A cheap length bound.** A prompt with more characters than ``max_model_len`` tokens could ever
  cover is refused without tokenizing it. The bound is sound, not a guess: it holds only for a
  tokenizer that keeps every character (byte-level BPE, or BPE with byte fallback, behind
  normalizers and pre-tokenizers that drop nothing); each token then covers at most as many
  characters as its longest vocabulary entry or added token has, times how far the normalizer
  can shrink text (NFC composes at most 4 code points into one). For any other tokenizer there
  is no bound, and the text is tokenized.
- **Message text is plain text.** The chat template writes control tokens (``<|im_start|>``...);
  the same text typed inside a message must not become one, or a user could forge a system turn.
  When a message holds a special token's text, the template's own special tokens are located in
  a rendering where that text is masked, and everything between them is tokenized with special
  tokens split into ordinary text. The tokenizer splits on added tokens before anything else, so
  the result equals the normal tokenization wherever no forged token was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from tokenizers import Tokenizer

from ember_server.engine.detokenizer import backend_tokenizer

# How many code points a normalizer may turn into one (None: any number, e.g. by deleting).
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "NFC": 4, "NFKC": 4, "Lowercase": 1, "Prepend": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
_MASK_CHARS = "#~^=x"


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer["type"]
    if kind == "Sequence":
        factor = 1
        for part in normalizer["normalizers"]:
            part_factor = _shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind == "Replace":
        pattern, content = normalizer["pattern"], normalizer["content"]
        if "String" not in pattern or not content:
            return None  # a regex or a deletion can shrink text without limit
        return max(1, -(-len(pattern["String"]) // len(content)))
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_all(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer["type"]
    if kind == "Sequence":
        return all(_keeps_all(p) for p in pre_tokenizer["pretokenizers"])
    if kind == "Split":
        return pre_tokenizer["behavior"] != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer["type"] == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer["pretokenizers"])
    return pre_tokenizer["type"] == "ByteLevel"


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of input text one token can stand for; None when no bound holds."""
    spec = json.loads(backend_tokenizer(tokenizer).to_str())
    model, pre_tokenizer = spec["model"], spec.get("pre_tokenizer")
    if model["type"] != "BPE" or not _keeps_all(pre_tokenizer):
        return None
    if not (model.get("byte_fallback") or _has_byte_level(pre_tokenizer)):
        return None  # characters outside the vocabulary may be dropped or fused
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    pieces = [*model["vocab"], *(t["content"] for t in spec.get("added_tokens", []))]
    return shrink * max(map(len, pieces))


class TextEncoder:
    """Tokenizes prompts and renders and tokenizes conversations for one model
    (``max_model_len`` tokens of context): the one way text becomes token ids, for the offline
    API and the HTTP routes alike (the ``InputProcessor`` holds it)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chars_per_token = max_chars_per_token(tokenizer)
        # A copy that reads special tokens' text as ordinary text: the tokenizer's own switch for
        # this is one flag on a shared object, unsafe while other threads tokenize.
        self._plain = Tokenizer.from_str(backend_tokenizer(tokenizer).to_str())
        self._plain.encode_special_tokens = True
        self._special_ids = {
            token.content: token_id
            for token_id, token in tokenizer.added_tokens_decoder.items()
            if token.special
        }
        self._special_text = (
            re.compile("|".join(map(re.escape, sorted(self._special_ids, key=len, reverse=True))))
            if self._special_ids
            else None
        )
        self._mask = next(c for c in _MASK_CHARS if not any(c in s for s in self._special_ids))

    def check_length(self, text: str, field: str) -> None:
        """``ValueError`` when ``text`` has more characters than the context could hold."""
        if self.chars_per_token is None:
            return
        if len(text) > self.max_model_len * self.chars_per_token:
            raise ValueError(
                f"{field} is {len(text)} characters long: more than this model's maximum "
                f"context length of {self.max_model_len} tokens can hold (a token of this "
                f"tokenizer covers at most {self.chars_per_token} characters)"
            )

    def encode(self, text: str, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        """Token ids of prompt text, after the length bound (``field`` names it in the error)."""
        self.check_length(text, field)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair as the tokenizer joins them (a cross-encoder's input)."""
        return list(self.tokenizer(first, second).input_ids)

    def render_chat(
        self, messages: Sequence[dict], tools=None, client_kwargs: dict | None = None, **options
    ) -> str:
        """The prompt text of a conversation (``[{"role": ..., "content": ...}, ...]``) through
        the chat template (``options["chat_template"]``, else the tokenizer's). The text already
        holds the template's special tokens (such as BOS)."""
        if not messages:
            raise ValueError("messages must hold at least one message")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if options.get("chat_template") is None and self.tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template")
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, **(client_kwargs or {}), **options
        )

    def encode_chat(
        self,
        messages: Sequence[dict],
        tools: list[dict] | None = None,
        client_kwargs: dict | None = None,
        **options,
    ) -> tuple[str, list[int]]:
        """The rendered text and token ids of ``messages`` through the chat template (rendered
        once, twice where a message holds a special token's text), with what the client wrote as plain
        text: the messages (all but their roles), ``tools`` and ``client_kwargs`` (extra template
        variables). ``options`` (``add_generation_prompt``, ``chat_template``, ...) are the
        caller's own and go to the template as they are.

        ``ValueError`` if client text holds a special token's text and the template does not copy
        it verbatim (then the template's own tokens cannot be told apart).
        """
        rendered = self.render_chat(messages, tools, client_kwargs, **options)
        client = {"messages": [_without_role(m) for m in messages], "tools": tools,
                  "kwargs": client_kwargs}  # fmt: skip
        self.check_length(rendered, "messages")
        if self._special_text is None or not any(map(self._special_text.search, _texts(client))):
            return rendered, self.tokenizer.encode(rendered, add_special_tokens=False)
        masked = self.render_chat(
            [{**_map_text(_without_role(m), self._mask_text), "role": m["role"]} for m in messages],
            _map_text(tools, self._mask_text),
            _map_text(client_kwargs, self._mask_text),
            **options,
        )
        if len(masked) != len(rendered):
            raise ValueError(
                "messages hold the text of a special token, and this chat template changes "
                "message text, so it cannot be kept as plain text; remove it from the messages"
            )
        ids: list[int] = []
        position = 0
        for match in self._special_text.finditer(masked):  # only the template's own are left
            start, end = match.span()
            ids += self._plain_ids(rendered[position:start])
            ids.append(self._special_ids[match.group()])
            position = end
        return rendered, ids + self._plain_ids(rendered[position:])

    def _mask_text(self, text: str) -> str:
        return self._special_text.sub(lambda m: self._mask * len(m.group()), text)

    def _plain_ids(self, text: str) -> list[int]:
        if not text:
            return []
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids


def _map_text(value, fn):
    """``value`` with ``fn`` applied to every string in it (through lists and dicts)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_text(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_text(v, fn) for k, v in value.items()}
    return value


def _without_role(message: dict) -> dict:
    return {key: value for key, value in message.items() if key != "role"}


def _texts(value) -> list[str]:
    """Every string in ``value``."""
    found: list[str] = []
    _map_text(value, found.append)
    return found
