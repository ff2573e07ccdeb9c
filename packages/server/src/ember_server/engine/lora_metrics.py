"""``ember:lora_requests_info``, as vLLM's ``vllm:lora_requests_info``: a gauge whose labels name
the adapters of the running and the waiting requests (comma-separated) and the per-step limit,
with the time of the report as its value; one series, the latest."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge

from ember_scheduler.engine_types import LoRAStats


class LoRAMetrics:
    """The adapter gauge of one ``EngineMetrics``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model_name = model_name
        self._gauge = Gauge(
            "ember:lora_requests_info",
            "Running and waiting LoRA adapters (label values), set to the report's time.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry,
        )

    def record(self, stats: LoRAStats) -> None:
        self._gauge.clear()  # only the latest state is a series
        self._gauge.labels(
            self._model_name, str(stats.max_loras), ",".join(stats.running), ",".join(stats.waiting)
        ).set(time.time())
