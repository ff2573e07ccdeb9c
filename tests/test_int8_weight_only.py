"""``quantization="int8_weight_only"`` through the offline API: greedy tokens equal, token for
token, transformers in float32 run on the dequantized weights (each linear weight but the q/k/v
projections quantized with group-wise scales, as every rank holds it), on one rank and under tensor
parallelism."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams
from ember_kernels.int8_linear import dequantize_int8, quantize_int8, weight_group_size
from ember_server import EngineArgs

PROMPTS = ["def parse(self, text):", "Grüße aus Köln, 日本語", "the quick brown fox"]
# Projections split along their input features under tensor parallelism: each rank quantizes its
# own slice of the input columns.
ROW_PARALLEL = ("o_proj", "down_proj")
# transformers' names for the projections Ember fuses into qkv_proj (FLOAT_PROJECTIONS).
QKV = ("q_proj", "k_proj", "v_proj")


def _round_trip(weight: torch.Tensor, input_slices: int) -> torch.Tensor:
    parts = weight.chunk(input_slices, dim=1)
    return torch.cat(
        [
            dequantize_int8(*quantize_int8(p, weight_group_size(p.shape[1])), torch.float32)
            for p in parts
        ],
        dim=1,
    )


def _dequantized_hf(path, tensor_parallel_size: int):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith(QKV):
                slices = tensor_parallel_size if name.endswith(ROW_PARALLEL) else 1
                # a new tensor: a tied head's copy is quantized, the embedding stays float
                module.weight = torch.nn.Parameter(_round_trip(module.weight, slices))
    return model


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("llama", {}),
        ("qwen2", {}),  # tied head, q/k/v bias
        ("llama", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
    ],
    ids=["llama", "qwen2-tied", "llama-tp2"],
)
def test_greedy_matches_transformers_on_dequantized_weights(tiny_model, arch, settings):
    path = tiny_model(arch)
    llm = LLM(
        str(path),
        dtype="float32",
        quantization="int8_weight_only",
        kv_cache_memory=4 * 1024**2,
        max_model_len=128,
        **settings,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    model = _dequantized_hf(path, settings.get("tensor_parallel_size", 1))
    for output in outputs:
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([output.prompt_token_ids]), max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(output.prompt_token_ids) :].tolist()  # fmt: skip
        assert output.outputs[0].token_ids == expected


def test_unknown_quantization_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"EngineArgs\.quantization"):
        EngineArgs(model="m", quantization="int4")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--model", "m", "--quantization", "int8_weight_only"])
    )
    assert args.quantization == "int8_weight_only"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quantization", "awq"])
