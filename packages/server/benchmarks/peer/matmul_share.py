"""What share of the matmul library's peak each engine's offline throughput is, and what a target
ratio against the best vLLM would need: the roofline beside ``bench_peer``'s offline rows.

A workload's matmul work is counted from the model's shapes: every token a request feeds through
the layers (its prompt, then each output token but the last) costs two FLOPs per layer weight, and
every output token two per LM-head weight (the head runs on a prompt's last position only).
Attention and the element-wise ops are left out, so the share is a lower bound of the time
matmuls take. The peak is ``ember_testing.roofline.matmul_peak`` at the dtype, measured in the
same run.
"""

from __future__ import annotations

import json
import pathlib


def linear_params(model_dir: str) -> tuple[int, int]:
    """(weights of every layer's linear projections, weights of the LM head) of a decoder-only
    model folder, from its ``config.json``."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = kv_heads or heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return config["num_hidden_layers"] * per_layer, config["vocab_size"] * hidden


def flops_per_output_token(model_dir: str, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Matmul FLOPs of a whole workload divided by its output tokens."""
    layers, head = linear_params(model_dir)
    fed = sum(p + o - 1 for p, o in zip(prompt_lens, output_lens))
    outputs = sum(output_lens)
    return 2 * (layers * fed + head * outputs) / outputs


def share_lines(figures: dict, flops_per_token: dict, peak: float, target: float) -> list[str]:
    """One line per offline workload: each engine's GFLOP/s and share of ``peak``, and the share
    ``target`` times the best vLLM figure would need."""
    lines = []
    for kind, per_token in flops_per_token.items():
        rates = {engine: f[kind] * per_token for engine, f in figures.items() if kind in f}
        best_peer = max(rate for engine, rate in rates.items() if engine != "ember")
        cells = ", ".join(
            f"{engine} {rate / 1e9:.0f} GFLOP/s ({100 * rate / peak:.0f}%)"
            for engine, rate in rates.items()
        )
        lines.append(
            f"offline {kind}, matmul share of the {peak / 1e9:.0f} GFLOP/s peak: {cells}; "
            f"{target:g}x the best vLLM needs {100 * target * best_peer / peak:.0f}%"
        )
    return lines
