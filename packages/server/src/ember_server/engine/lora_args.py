"""The LoRA settings of ``EngineArgs`` (vLLM's names): the command-line flags and the one
``LoRAConfig`` that the scheduler and every worker rank receive."""

from __future__ import annotations

import argparse

from ember_scheduler.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig


def make_lora_config(args) -> LoRAConfig | None:
    """``args``' adapter limits (``enable_lora``, ``max_loras``, ``max_lora_rank``,
    ``max_cpu_loras``), validated; None where LoRA is off."""
    if args.enable_lora not in (True, False):
        raise ValueError(f"EngineArgs.enable_lora must be a bool, got {args.enable_lora!r}")
    if not args.enable_lora:
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def add_lora_cli_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters (PEFT folders) on top of the model.",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help="Most distinct adapters in one step (each holds a weight slot on the device).",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help="Highest adapter rank accepted.",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="Loaded adapters kept in host memory (least recently used dropped); default: "
        "--max-loras.",
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_lora_modules_arg(parser: argparse.ArgumentParser) -> None:
    """``ember serve --lora-modules name=path ...``: adapters served by name (a dict)."""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve, each chosen by its name in the request's "
        "model field (needs --enable-lora).",
    )
