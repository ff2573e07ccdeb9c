"""The tokenizer class ``AutoTokenizer`` picked for a model folder, remembered across starts.

``AutoTokenizer`` chooses between the class a folder declares, the one its model type registers
and ``TokenizersBackend`` by rules that read the model's config, and a config read through
transformers imports torch, the longest leg of the API server's start-up (the server README has
the figures). The class it picked is written under the user's
cache (``$XDG_CACHE_HOME/ember/tokenizer-classes``), keyed by the folder's path, the name, size
and modification time of every file in it, and the transformers and tokenizers versions; a later
start imports that class alone (no torch) and loads the folder with it, as ``AutoTokenizer``
itself ends by doing.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import pathlib
import tempfile

logger = logging.getLogger(__name__)


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "ember" / "tokenizer-classes"


def _entry(folder: pathlib.Path) -> pathlib.Path:
    files = sorted(
        (entry.name, stat.st_size, stat.st_mtime_ns)
        for entry in os.scandir(folder)
        if entry.is_file() and (stat := entry.stat())
    )
    versions = [importlib.metadata.version(p) for p in ("transformers", "tokenizers")]
    key = json.dumps([str(folder.resolve()), versions, files])
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def cached_tokenizer_class(folder: pathlib.Path) -> type | None:
    """The class remembered for ``folder`` as it is now; None when there is none (or it is gone
    from this transformers)."""
    try:
        name = json.loads(_entry(folder).read_text())["class"]
        module, _, qualname = name.partition(":")
        if not module.startswith("transformers."):
            return None
        return getattr(importlib.import_module(module), qualname)
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None


def remember_tokenizer_class(folder: pathlib.Path, cls: type) -> None:
    """Write ``cls`` down for ``folder`` (transformers' own classes only); a cache that cannot be
    written is skipped."""
    if not cls.__module__.startswith("transformers."):
        return
    entry = _entry(folder)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False) as file:
            json.dump({"class": f"{cls.__module__}:{cls.__qualname__}"}, file)
        os.replace(file.name, entry)  # readers see the old entry or the whole new one
    except OSError as exc:
        logger.debug("tokenizer class cache not written (%s)", exc)
