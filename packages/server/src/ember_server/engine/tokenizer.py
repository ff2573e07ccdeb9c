"""Loading the model's tokenizer and rendering chat conversations through its template."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from ember_server.engine.detokenizer import backend_tokenizer
from ember_server.engine.tokenizer_class_cache import (
    cached_tokenizer_class,
    remember_tokenizer_class,
)


def load_tokenizer(path: str):
    """The fast Hugging Face tokenizer in ``path``, of the class ``AutoTokenizer`` picks for it
    (remembered from an earlier start where the folder is unchanged: see
    ``tokenizer_class_cache``)."""
    folder = pathlib.Path(path).expanduser()
    is_folder = folder.is_dir()  # a hub id goes to AutoTokenizer each time
    cls = cached_tokenizer_class(folder) if is_folder else None
    try:
        if cls is not None:
            tokenizer = cls.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
            if is_folder:
                remember_tokenizer_class(folder, type(tokenizer))
    except (OSError, ValueError) as exc:
        raise ValueError(f"EngineArgs.tokenizer {path!r} holds no usable tokenizer: {exc}") from exc
    backend_tokenizer(tokenizer)  # fail now, not at the first request
    return tokenizer


def render_chat(
    tokenizer,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs,
) -> str:
    """The prompt text of a conversation (``[{"role": ..., "content": ...}, ...]``).

    The text already holds the template's special tokens (such as BOS): tokenize it with
    ``add_special_tokens=False``.
    """
    if not messages:
        raise ValueError("messages must hold at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template")
    return tokenizer.apply_chat_template(
        list(messages),
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
