"""pytest fixtures of the tiny-model factory, registered for every test run that installs it."""

from __future__ import annotations

import pytest

from ember_testing.tiny_models import (
    ARCHITECTURES,
    tiny_classifier_path,
    tiny_model_path,
    tokenizer_path,
)


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: ``tiny_model(arch, seed=0, **config_overrides)`` -> path of a cached HF folder."""
    return tiny_model_path


@pytest.fixture(scope="session")
def tiny_classifier():
    """Factory: ``tiny_classifier(arch, num_labels=3, seed=0, **config_overrides)`` -> path of a
    cached ``*ForSequenceClassification`` folder."""
    return tiny_classifier_path


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny_model_any(request):
    """Path of the default tiny model, once per architecture."""
    return tiny_model_path(request.param)


@pytest.fixture(scope="session")
def test_tokenizer_path():
    return tokenizer_path()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh ``redis-server`` on a unix socket: (process, URL); killed after the test. Fails
    (never skips) where redis-server is not installed: ``.ci/run`` installs it."""
    import shutil
    import subprocess
    import time

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    sock = tmp_path / "redis.sock"
    process = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("redis-server did not open its socket")
        time.sleep(0.05)
    yield process, f"unix://{sock}"
    process.kill()
    process.wait()
