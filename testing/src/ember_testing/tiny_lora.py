"""Tiny LoRA adapters for the tests: real PEFT folders with random weights over a tiny model,
their fused-projection twins, and the PEFT-merged transformers model that is the reference.

Needs peft (a test dependency of the packages whose tests call it).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from ember_server.cli.demo_model import _digest, _write_atomically, cache_dir

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def tiny_lora_path(
    base: pathlib.Path,
    seed: int = 0,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Sequence[str] = ATTENTION + MLP,
    use_rslora: bool = False,
) -> pathlib.Path:
    """Path of a cached PEFT adapter of ``base`` whose A and B are both random (a fresh PEFT
    adapter's B is zero, which would change nothing), written on first use."""
    spec = dict(
        v=1,
        base=str(base),
        seed=seed,
        r=r,
        alpha=lora_alpha,
        targets=sorted(target_modules),
        rslora=use_rslora,
    )

    def write(out: pathlib.Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(
            r=r,
            lora_alpha=lora_alpha,
            target_modules=list(target_modules),
            use_rslora=use_rslora,
            lora_dropout=0.0,
        )
        peft_model = get_peft_model(model, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    fan_in = param.shape[1]
                    param.copy_(torch.randn(param.shape, generator=gen) * (0.5 / fan_in**0.5))
        peft_model.save_pretrained(out)

    return _write_atomically(cache_dir() / f"lora-{_digest(spec)}", write)


def fused_lora_path(adapter: pathlib.Path) -> pathlib.Path:
    """The same adapter as one trained against fused ``qkv_proj``/``gate_up_proj`` projections:
    each fused module's A is its parts' A stacked (rank times the parts) and its B their B
    block-diagonal, with ``lora_alpha`` scaled to keep ``alpha / r`` (so the delta is equal).
    ``adapter`` must adapt all of q/k/v and gate/up, without rsLoRA."""

    def write(out: pathlib.Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        settings = json.loads((adapter / "adapter_config.json").read_text())
        tensors = load_file(adapter / "adapter_model.safetensors")
        fused: dict[str, torch.Tensor] = {}
        groups = {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        }
        prefixes = {n.rsplit(".", 3)[0].rsplit(".", 1)[0] for n in tensors}
        for prefix in prefixes:
            for fused_name, parts in groups.items():
                names = [f"{prefix}.{p}.lora_{{}}.weight" for p in parts]
                if not all(n.format("A") in tensors for n in names):
                    continue
                a = torch.cat([tensors.pop(n.format("A")) for n in names])
                b = torch.block_diag(*[tensors.pop(n.format("B")) for n in names])
                fused[f"{prefix}.{fused_name}.lora_A.weight"] = a
                fused[f"{prefix}.{fused_name}.lora_B.weight"] = b
        # One rank for every module, as PEFT writes: the largest group's (3r), zero-padded.
        factor = 3
        merged = {**tensors, **fused}
        rank = factor * settings["r"]
        for name, t in merged.items():
            if ".lora_A." in name and t.shape[0] < rank:
                merged[name] = torch.cat([t, t.new_zeros(rank - t.shape[0], t.shape[1])])
            elif ".lora_B." in name and t.shape[1] < rank:
                merged[name] = torch.cat([t, t.new_zeros(t.shape[0], rank - t.shape[1])], dim=1)
        save_file(merged, out / "adapter_model.safetensors")
        names = set(settings["target_modules"]) - {
            "q_proj",
            "k_proj",
            "v_proj",
            "gate_proj",
            "up_proj",
        }
        settings["target_modules"] = sorted(names | {"qkv_proj", "gate_up_proj"})
        settings["r"] *= factor
        settings["lora_alpha"] *= factor
        (out / "adapter_config.json").write_text(json.dumps(settings))

    spec = dict(v=1, fused_from=str(adapter))
    return _write_atomically(cache_dir() / f"lora-fused-{_digest(spec)}", write)


def merged_hf_model(base: pathlib.Path, adapter: pathlib.Path):
    """transformers' model of ``base`` with ``adapter`` merged into its weights by PEFT
    (``merge_and_unload``), float32, in eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return merged.eval()
