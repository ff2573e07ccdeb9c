"""LoRA adapters as the scheduler and every other side see them: which adapter a request runs
with (``LoRARequest``, vLLM's fields) and the limits on adapters (``LoRAConfig``)."""

from __future__ import annotations

import msgspec

from ember_scheduler.config import check_int

# vLLM's default limits.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter to run a request with: its name (what prefix-cache hashes and the OpenAI
    ``model`` field use), a positive integer id unique per adapter, and its PEFT folder
    (``adapter_config.json`` plus ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}"
            )
        check_int("LoRARequest.lora_int_id", self.lora_int_id)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"LoRARequest.lora_path must be a non-empty string, got {self.lora_path!r}"
            )

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRAConfig(msgspec.Struct, frozen=True):
    """Limits on adapters, the same for the scheduler and every worker rank: at most
    ``max_loras`` distinct adapters run in one step (each holds one of as many weight slots on
    the device), each of rank at most ``max_lora_rank``; up to ``max_cpu_loras`` loaded adapters
    wait in host memory (least recently used dropped first; default ``max_loras``)."""

    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)
        check_int("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
