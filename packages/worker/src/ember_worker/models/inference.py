"""``inference``: torch's inference mode around a model's entry points, entered only where the
caller has not entered it already (the model runner's step has)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def inference(fn: F) -> F:
    """``fn`` under ``torch.inference_mode()``; a call already in inference mode (every call of
    a model step) goes straight through, saving the mode's enter and exit at each call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
