"""LoRA adapters on a worker rank: PEFT folders read and checked (``adapter``), each linear
layer's adapter slots and delta (``layers``), and the slots, host cache and step mapping of a
rank (``manager``)."""

from ember_worker.lora.adapter import LoRAAdapter, load_adapter
from ember_worker.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAManager", "load_adapter"]
