"""W8A8 int8 compressed-tensors checkpoints through the offline API: greedy tokens equal, token
for token, transformers in float32 running the checkpoint's own int8 weights and scales with each
linear layer's input quantized per token, on one rank and under tensor parallelism.

The reference forms each layer's integer sums exactly (in float64, as int32 sums them) and then
scales them in float32 as the kernel does, so the two agree to the bit and greedy tokens must be
equal, not just close."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams
from ember_server import EngineArgs
from ember_testing.tiny_models import W8A8_PROJECTIONS, tiny_model_path, tiny_w8a8_model_path

PROMPTS = ["def parse(self, text):", "Grüße aus Köln, 日本語", "the quick brown fox"]
# Under tensor parallelism these take a slice of the input features on each rank, and each rank
# quantizes its own slice per token.
ROW_PARALLEL = ("o_proj", "down_proj")


class FakeQuantLinear(torch.nn.Module):
    """An int8 ``q [out, in]`` with float32 scales ``s [out]``; the input is quantized per token
    (per slice of ``input_slices``) and the integer sums scaled back."""

    def __init__(self, q, scale, bias, input_slices):
        super().__init__()
        self.q, self.scale, self.bias, self.input_slices = q, scale, bias, input_slices

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).float()
        out = 0
        for xs, qs in zip(
            rows.chunk(self.input_slices, 1), self.q.chunk(self.input_slices, 1), strict=True
        ):
            amax = xs.abs().amax(1)
            sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            xq = torch.round(xs / sx[:, None]).clamp(-127, 127)
            sums = (xq.double() @ qs.double().T).float()
            out = out + sums * sx[:, None] * self.scale[None, :]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], -1)


def _reference(arch: str, w8a8_path, tensor_parallel_size: int):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(arch), dtype=torch.float32)
    tensors = load_file(w8a8_path / "model.safetensors")
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in W8A8_PROJECTIONS:
            slices = tensor_parallel_size if name.endswith(ROW_PARALLEL) else 1
            quantized = FakeQuantLinear(
                tensors[f"{name}.weight"],
                tensors[f"{name}.weight_scale"].reshape(-1),
                module.bias,
                slices,
            )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized)
    return model.eval()


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("llama", {}),
        ("qwen2", {}),  # tied head (float), q/k/v bias
        ("llama", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
    ],
    ids=["llama", "qwen2-tied", "llama-tp2"],
)
def test_greedy_matches_transformers_with_per_token_activation_quantization(arch, settings):
    path = tiny_w8a8_model_path(arch)
    llm = LLM(
        str(path), dtype="float32", kv_cache_memory=4 * 1024**2, max_model_len=128, **settings
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    model = _reference(arch, path, settings.get("tensor_parallel_size", 1))
    for output in outputs:
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([output.prompt_token_ids]), max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(output.prompt_token_ids) :].tolist()  # fmt: skip
        assert output.outputs[0].token_ids == expected


def test_engine_args_take_vllms_name_for_the_checkpoints_own_quantization():
    assert EngineArgs(model="m", quantization="compressed-tensors").quantization == (
        "compressed-tensors"
    )
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--quantization", "compressed-tensors"])
    assert EngineArgs.from_cli_args(args).quantization == "compressed-tensors"
