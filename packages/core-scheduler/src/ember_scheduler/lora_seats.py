"""The adapter limit of a step: the running requests use at most ``max_loras`` distinct LoRA
adapters, so that every scheduled adapter has a weight slot on the workers."""

from __future__ import annotations

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.request import Request


class AdapterSeats:
    """The distinct adapters of the running requests (every running request may be scheduled,
    so all of theirs count) and how many more fit; ``limit`` None: adapters are off."""

    __slots__ = ("active", "limit")

    def __init__(self, active: set[int], limit: int | None) -> None:
        self.active = active
        self.limit = limit

    @classmethod
    def of(cls, config: SchedulerConfig, running: list[Request]) -> AdapterSeats:
        if config.lora is None:
            return cls(set(), None)
        active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        return cls(active, config.lora.max_loras)

    def has_seat(self, request: Request) -> bool:
        """Whether ``request`` may run now: no adapter, or one already running, or room for
        one more."""
        lora = request.lora_request
        return (
            lora is None
            or self.limit is None
            or lora.lora_int_id in self.active
            or len(self.active) < self.limit
        )

    def take(self, request: Request) -> None:
        if request.lora_request is not None:
            self.active.add(request.lora_request.lora_int_id)
