"""Loading the model's tokenizer (chat rendering and tokenization: ``text_encoding``)."""

from __future__ import annotations

import pathlib

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
