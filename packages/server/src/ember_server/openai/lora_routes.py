"""LoRA adapters over HTTP: the adapter cards of ``/v1/models`` and, behind the opt-in
``EMBER_ALLOW_RUNTIME_LORA_UPDATING`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), the routes
that load and unload adapters while serving. The engine's ``input_processor.loras``
(``LoRARegistry``) is the one list of served adapters; unloading one stops new requests from
naming it, while the requests already sent with it run to their end."""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ember_server.openai.errors import OpenAIError
from ember_server.openai.protocol import ModelCard

RUNTIME_UPDATING_ENV = "EMBER_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


def adapter_cards(engine, base_name: str, max_model_len: int) -> list[ModelCard]:
    """One card per served adapter, its parent the base model's served name."""
    return [
        ModelCard(id=r.lora_name, root=r.lora_path, parent=base_name, max_model_len=max_model_len)
        for r in engine.input_processor.loras.served
    ]


def register_lora_modules(engine, lora_modules: dict[str, str] | None) -> None:
    """Serve ``--lora-modules`` (name -> PEFT folder); ValueError names a bad one."""
    for name, path in (lora_modules or {}).items():
        engine.input_processor.loras.add_named(name, path)


def install_lora_routes(app: FastAPI, engine, base_name: str) -> None:
    """Add the load/unload routes when ``EMBER_ALLOW_RUNTIME_LORA_UPDATING`` is set."""
    if not runtime_updating_allowed():
        return
    loras = engine.input_processor.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if request.lora_name == base_name:
            raise OpenAIError(
                f"lora_name {request.lora_name!r} is the base model's name", 400, "lora_name"
            )
        try:
            loras.add_named(request.lora_name, request.lora_path)
        except ValueError as exc:
            raise OpenAIError(
                str(exc), 400, "lora_name" if "already" in str(exc) else "lora_path"
            ) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            loras.remove_named(request.lora_name)
        except KeyError:
            raise OpenAIError(
                f"The lora adapter '{request.lora_name}' cannot be found.", 404, "lora_name"
            ) from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )
