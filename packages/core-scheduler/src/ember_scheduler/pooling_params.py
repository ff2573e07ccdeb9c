"""Pooling parameters: what a pooling request (embed or classify) returns instead of tokens."""

from __future__ import annotations

import msgspec

from ember_scheduler.sampling_params import INT32_MAX

POOLING_TASKS = ("embed", "classify")
POOLING_TYPES = ("last", "mean", "cls")


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """How to pool one request's prompt hidden states; validated on construction and when
    decoded (ValueError naming the field).

    ``task="embed"``: the hidden states of the final norm pooled by ``pooling_type`` (``last``
    token, ``mean`` over the prompt, or the first, ``cls``, token), truncated to ``dimensions``
    (Matryoshka) and then L2-normalized when ``normalize``. ``task="classify"``: the last token's
    hidden state through the model's ``score`` head, then softmax over the labels (sigmoid with a
    single label) when ``use_activation``.

    A pooling request finishes after its prompt; it samples nothing. Pooling that reads positions
    before the last (``mean``, ``cls``) cannot use the prefix cache: the positions must be
    computed.
    """

    task: str = "embed"
    pooling_type: str | None = None  # None: the engine's default (``last`` in the worker)
    normalize: bool = True
    dimensions: int | None = None
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            _fail("task", self.task, f"must be one of {POOLING_TASKS}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            _fail("pooling_type", self.pooling_type, f"must be one of {POOLING_TYPES}")
        if self.task == "classify" and self.pooling_type not in (None, "last"):
            _fail("pooling_type", self.pooling_type, "must be 'last' for task 'classify'")
        for name in ("normalize", "use_activation"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be a bool")
        dims = self.dimensions
        if dims is not None and (
            not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= INT32_MAX
        ):
            _fail("dimensions", dims, "must be a positive int or None")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether cached prompt blocks may be skipped: only the last position is pooled."""
        return self.pooling_type in (None, "last")

    def clone(self, **changes) -> PoolingParams:
        return msgspec.structs.replace(self, **changes)


def _fail(field: str, value, rule: str) -> None:
    raise ValueError(f"PoolingParams.{field} {rule}, got {value!r}")
