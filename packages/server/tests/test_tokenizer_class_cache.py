"""The tokenizer class AutoTokenizer picks, remembered: the same tokenizer, without torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from transformers import AutoTokenizer

from ember_server.engine.text_encoding import TextEncoder
from ember_server.engine.tokenizer import load_tokenizer
from ember_server.engine.tokenizer_class_cache import cache_dir
from ember_testing.tiny_models import ARCHITECTURES

TEXT = "Hello <|im_start|> wörld, 12345!\n  <|eos|>"
MESSAGES = [{"role": "user", "content": "Hi there"}]

# Loads each folder's tokenizer as the API server does, with its model config, and prints what
# it got; with --no-torch it fails if torch was imported.
_LOAD = """
import json, sys
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.model_config import ModelConfig
from ember_server.engine.text_encoding import TextEncoder
from ember_server.engine.tokenizer import load_tokenizer
got = {}
for path in sys.argv[1:-1]:
    ModelConfig.from_engine_args(EngineArgs(model=path))
    tok = load_tokenizer(path)
    got[path] = [type(tok).__name__, tok(%r).input_ids, tok.decode(tok(%r).input_ids),
                 TextEncoder(tok, 64).render_chat(%r, add_generation_prompt=True)]
if sys.argv[-1] == "--no-torch":
    assert "torch" not in sys.modules, "torch was imported"
print(json.dumps(got))
""" % (TEXT, TEXT, MESSAGES)  # noqa: UP031 - the script's own braces


def _load_in_a_new_process(paths, cache_home, no_torch: bool) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, *paths, "--no-torch" if no_torch else "--first"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _auto(path) -> list:
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT).input_ids
    return [
        type(tok).__name__,
        ids,
        tok.decode(ids),
        TextEncoder(tok, 64).render_chat(MESSAGES, add_generation_prompt=True),
    ]


def test_a_later_start_loads_the_same_tokenizer_without_torch(tiny_model, tmp_path):
    paths = [str(tiny_model(arch)) for arch in ARCHITECTURES]
    expected = {path: _auto(path) for path in paths}
    assert {e[0] for e in expected.values()} == {"TokenizersBackend", "Qwen2Tokenizer"}
    first = _load_in_a_new_process(paths, tmp_path, no_torch=False)
    assert first == expected
    assert len(list((tmp_path / "ember" / "tokenizer-classes").iterdir())) == len(paths)
    assert _load_in_a_new_process(paths, tmp_path, no_torch=True) == expected


def test_a_changed_folder_is_resolved_again(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), folder)
    assert type(load_tokenizer(str(folder))).__name__ == "TokenizersBackend"
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(AutoTokenizer.from_pretrained(folder)).__name__ == "Qwen2Tokenizer"
    assert type(load_tokenizer(str(folder))).__name__ == "Qwen2Tokenizer"


def test_a_bad_cache_entry_is_ignored_and_replaced(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(tiny_model("qwen2"))
    load_tokenizer(path)
    (entry,) = cache_dir().iterdir()
    for bad in ("{broken", '{"class": "os:system"}', '{"class": "transformers:NoSuchClass"}'):
        entry.write_text(bad)
        assert type(load_tokenizer(path)).__name__ == "Qwen2Tokenizer"
        assert json.loads(entry.read_text())["class"].endswith(":Qwen2Tokenizer")


def test_an_unwritable_cache_is_skipped(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "ember").write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert type(load_tokenizer(str(tiny_model("qwen2")))).__name__ == "Qwen2Tokenizer"
