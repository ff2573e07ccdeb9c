"""Fixtures shared by the server tests."""

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    """One event loop per module: engines and async clients belong to the loop they start on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
