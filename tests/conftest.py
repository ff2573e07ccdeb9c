"""Fixtures shared by the cross-package tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """A tiny model runs fastest on one intra-op thread; restore the setting afterwards.

    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
