"""The front end's LoRA adapters: each ``LoRARequest`` checked against the model once, before it
reaches an engine core, and the adapters the server knows by name (``--lora-modules`` and those
loaded at run time), each with the id the engine keys it by."""

from __future__ import annotations

import itertools

from ember_scheduler.lora import LoRAConfig, LoRARequest


class LoRARegistry:
    """Adapters of one model. ``check`` refuses a request for an engine without LoRA, an id or
    name already taken by another adapter, and an adapter that cannot run on the model
    (``ember_worker.lora.load_adapter``'s errors, which name the adapter and the field)."""

    def __init__(self, model: str, lora_config: LoRAConfig | None) -> None:
        self.model = model
        self.lora_config = lora_config
        self._checked: dict[int, LoRARequest] = {}
        self._named: dict[str, LoRARequest] = {}  # served by name, in load order
        self._next_id = itertools.count(1)
        self._decoder_config = None

    @property
    def enabled(self) -> bool:
        return self.lora_config is not None

    def check(self, request: LoRARequest | None) -> LoRARequest | None:
        """``request`` once it is known to run here (None passes: the base model)."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.lora_config is None:
            raise ValueError(
                f"lora_request {request.lora_name!r}: LoRA is not enabled "
                "(EngineArgs.enable_lora, --enable-lora)"
            )
        known = self._checked.get(request.lora_int_id)
        if known == request:
            return request
        if known is not None:
            raise ValueError(
                f"lora_request {request.lora_name!r}: lora_int_id {request.lora_int_id} already "
                f"names adapter {known.lora_name!r} ({known.lora_path})"
            )
        same_name = next(
            (r for r in self._checked.values() if r.lora_name == request.lora_name), None
        )
        if same_name is not None:
            raise ValueError(
                f"lora_request {request.lora_name!r}: lora_name is already the name of adapter "
                f"id {same_name.lora_int_id} ({same_name.lora_path})"
            )
        import torch

        from ember_worker.lora import load_adapter

        load_adapter(request, self._model_config(), self.lora_config.max_lora_rank, torch.float32)
        self._checked[request.lora_int_id] = request
        return request

    def _model_config(self):
        if self._decoder_config is None:
            from ember_worker.hf_config import load_hf_config, resolve_model_path
            from ember_worker.models import DecoderConfig

            hf_config = load_hf_config(resolve_model_path(self.model))
            self._decoder_config = DecoderConfig.from_hf_config(hf_config)
        return self._decoder_config

    # ---------------------------------------------------------------- served by name

    def add_named(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name`` (a fresh id); ValueError as ``check``."""
        if name in self._named:
            raise ValueError(f"lora_name {name!r} is already loaded")
        request = self.check(LoRARequest(name, self._free_id(), str(path)))
        self._named[name] = request
        return request

    def remove_named(self, name: str) -> LoRARequest:
        """Stop serving ``name``; KeyError when it is not served. Requests already sent with it
        run to their end (the engines keep the adapter until it is evicted)."""
        request = self._named.pop(name)
        del self._checked[request.lora_int_id]
        return request

    def named(self, name: str) -> LoRARequest | None:
        return self._named.get(name)

    @property
    def served(self) -> list[LoRARequest]:
        return list(self._named.values())

    def _free_id(self) -> int:
        # Ids are never reused: an engine may still hold an unloaded adapter under its id.
        while True:
            candidate = next(self._next_id)
            if candidate not in self._checked:
                return candidate
