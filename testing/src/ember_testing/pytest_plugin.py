"""pytest fixtures of the tiny-model factory, registered for every test run that installs it."""

from __future__ import annotations

import pytest

from ember_testing.tiny_models import ARCHITECTURES, tiny_model_path, tokenizer_path


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: ``tiny_model(arch, seed=0, **config_overrides)`` -> path of a cached HF folder."""
    return tiny_model_path


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_model_any(request):
    """Path of the default tiny model, once per architecture."""
    return tiny_model_path(request.param)


@pytest.fixture(scope="session")
def test_tokenizer_path():
    return tokenizer_path()
