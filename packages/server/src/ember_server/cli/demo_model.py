"""Ember's built-in demo model: a tiny random-weight Llama with a real, offline-trained tokenizer.

``ember serve``, ``ember generate`` and ``ember bench`` use it when no model is given. It is
written on first use as a genuine Hugging Face folder (config.json, safetensors,
generation_config.json, tokenizer.json with a chat template), so it loads through the real loading
code of any engine, and cached under ``EMBER_TINY_MODELS_DIR`` (default: ``ember-tiny-models`` in
the system temp dir), keyed by a digest of everything that determines its content. The tokenizer
is a byte-level BPE trained on the source of a few stdlib modules, which ship with every Python.

``random_model_path`` writes a model of any config this way; the repository's private test-model
factory (``ember_testing.tiny_models``) builds its architectures on it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any

FACTORY_VERSION = 2
VOCAB_SIZE = 2048
# <|endoftext|> is in the vocabulary because transformers' Qwen2 tokenizer class adds it otherwise.
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Text outside ASCII, so that byte-level merges cover multi-byte characters too.
UNICODE_SAMPLE = (
    "Grüße aus Köln, naïve café, São Paulo, Ελληνικά, русский язык, 日本語のテキスト, "
    "中文字符, 한국어, emoji 🙂🔥🚀 and math ∑ ∫ √ ≤ ≥ ≠ π."
)
# Stdlib modules whose source is the tokenizer's training text: it ships with every Python.
CORPUS_MODULES = ("textwrap", "difflib", "argparse", "string", "json.decoder", "calendar")

# What every model written here shares: small sizes, and the tokenizer's vocabulary and ids.
BASE_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Llama 3 rope scaling, with an original context short enough that it changes frequencies.
LLAMA_CONFIG = dict(
    tie_word_embeddings=False,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)
DEMO_MODEL_NAME = "ember-demo"
# A Llama a few MB in size: big enough to batch meaningfully, small enough to write in seconds.
# Its heads are the base's (4 query, 2 KV).
DEMO_MODEL_CONFIG = dict(
    LLAMA_CONFIG,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    max_position_embeddings=2048,
)


def demo_model_path() -> str:
    """Folder of the demo model, written (offline, a few seconds) on first use."""
    return str(random_model_path("llama", seed=0, **DEMO_MODEL_CONFIG))


def random_model_path(
    model_type: str,
    seed: int = 0,
    max_shard_size: str | None = None,
    sequence_classification: bool = False,
    **config: Any,
) -> pathlib.Path:
    """Path of a cached float32 model of the transformers ``model_type``, written on first use.

    Its config is ``BASE_CONFIG`` updated with ``config``; its weights are random, drawn from
    ``seed``; its tokenizer is ``tokenizer_path()``'s. ``max_shard_size`` (e.g. ``"200KB"``)
    splits the weights into several safetensors files with an index. ``sequence_classification``
    writes transformers' ``*ForSequenceClassification`` (a ``score`` head of ``num_labels``)
    instead of the causal LM.
    """
    kind = f"{model_type}-cls" if sequence_classification else model_type
    # The folder's name digests transformers' full config, which takes importing transformers
    # (seconds, on every start); a note named by the arguments and transformers' version finds
    # a folder written before without that import.
    request = dict(
        v=FACTORY_VERSION, arch=kind, seed=seed, shard=max_shard_size,
        config={**BASE_CONFIG, **config}, transformers=_transformers_version(),
    )  # fmt: skip
    note = cache_dir() / f".{kind}-request-{_digest(request)}"
    with contextlib.suppress(OSError):
        written = cache_dir() / note.read_text().strip()
        if written.is_dir():
            return written

    from transformers import AutoConfig

    # A deep copy: transformers fills nested dicts in place (rope_scaling gains rope_theta), which
    # would change this module's configs, and with them every later request's note, in-process.
    model_config = AutoConfig.for_model(model_type, **copy.deepcopy({**BASE_CONFIG, **config}))
    tokenizer = tokenizer_path()
    spec = dict(
        v=FACTORY_VERSION,
        arch=model_type,
        seed=seed,
        shard=max_shard_size,
        config=model_config.to_dict(),
    )
    spec["config"].pop("transformers_version", None)
    if sequence_classification:
        spec["head"] = "sequence_classification"

    def write(out: pathlib.Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        torch.manual_seed(seed)
        if sequence_classification:
            model = AutoModelForSequenceClassification.from_config(
                model_config, dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
            model.generation_config.do_sample = False
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out, safe_serialization=True, **kwargs)
        for item in tokenizer.iterdir():
            shutil.copy2(item, out / item.name)

    target = _write_atomically(cache_dir() / f"{kind}-{_digest(spec)}", write)
    with contextlib.suppress(OSError):  # a read-only cache still serves, only slower
        _write_note(note, target.name)
    return target


def _transformers_version() -> str:
    """transformers' installed version, read from its metadata (no import)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _write_note(note: pathlib.Path, text: str) -> None:
    tmp = note.with_name(f"{note.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(note)


def tokenizer_path() -> pathlib.Path:
    """Folder holding the shared offline-trained byte-level BPE tokenizer."""
    spec = dict(v=FACTORY_VERSION, corpus=CORPUS_MODULES, py=sys.version_info[:2], vocab=VOCAB_SIZE)
    return _write_atomically(cache_dir() / f"tokenizer-{_digest(spec)}", _train_tokenizer)


def cache_dir() -> pathlib.Path:
    root = os.environ.get("EMBER_TINY_MODELS_DIR")
    path = pathlib.Path(root) if root else pathlib.Path(tempfile.gettempdir()) / "ember-tiny-models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _corpus() -> list[str]:
    import importlib
    import inspect

    texts = [inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES]
    return [*texts, UNICODE_SAMPLE * 20]


def _digest(spec: dict[str, Any]) -> str:
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _write_atomically(target: pathlib.Path, write) -> pathlib.Path:
    """Write a folder through ``write(tmp_dir)`` and move it into place in one rename."""
    if target.is_dir():
        return target
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process got there first; its folder is identical
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _train_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=BASE_CONFIG["max_position_embeddings"],
    )
    fast.save_pretrained(out)
