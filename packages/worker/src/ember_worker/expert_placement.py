"""The expert placements a user may choose (``--expert-placement-strategy``), importable without
torch (the API server validates settings with it). They name ``ember_kernels.moe.ExpertPlacement``'s
strategies: ``"linear"`` gives each expert-parallel rank a contiguous block of experts,
``"round_robin"`` deals expert ``e`` to rank ``e % ranks``."""

from __future__ import annotations

EXPERT_PLACEMENT_STRATEGIES = ("linear", "round_robin")


def check_expert_placement(value: object, field: str = "expert_placement_strategy") -> None:
    """ValueError naming ``field`` unless ``value`` is one of the strategies."""
    if value not in EXPERT_PLACEMENT_STRATEGIES:
        raise ValueError(f"{field} must be one of {EXPERT_PLACEMENT_STRATEGIES}, got {value!r}")
