"""LoRA adapters on several ranks (multiprocess executor, gloo), greedy tokens equal to
transformers running the PEFT-merged model in float32: at tensor parallel size 2 each rank holds
its shard of every adapter (column-parallel layers cut B, row-parallel layers cut A and sum the
shrink); at pipeline parallel size 2 each stage holds its layers' part. (Data parallel engines
run behind ``ember serve -dp``: packages/server/tests/test_http_lora.py.)"""

from __future__ import annotations

import pytest
import torch

from ember import LLM, LoRARequest, SamplingParams
from ember_testing.tiny_lora import merged_hf_model, tiny_lora_path
from ember_testing.tiny_models import tiny_model_path

pytest.importorskip("peft")

MAX_TOKENS = 10
PROMPTS = [[1, 40, 41, 42, 50, 60, 61], [7, 8, 9, 10, 11, 12], [3, 90, 17, 5]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"tensor_parallel_size": 2}, id="tp2"),
        pytest.param({"pipeline_parallel_size": 2}, id="pp2"),
    ],
)
def test_mixed_adapters_on_two_ranks_match_the_merged_models(parallel):
    base = tiny_model_path("llama")  # 4 query heads, 2 KV heads: both split over 2 ranks
    loras = [
        LoRARequest("all", 1, str(tiny_lora_path(base, seed=31, r=8, lora_alpha=16))),
        LoRARequest(
            "attn",
            2,
            str(
                tiny_lora_path(base, seed=32, r=4, target_modules=("k_proj", "o_proj", "down_proj"))
            ),
        ),
    ]
    llm = LLM(
        str(base),
        dtype="float32",
        **parallel,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=64,
        kv_cache_memory=1024**2,
    )
    try:
        requests = [loras[0], None, loras[1]]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            params,
            lora_request=requests,
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    for output, prompt, lora in zip(outputs, PROMPTS, requests):
        if lora is None:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        else:
            hf = merged_hf_model(base, lora.lora_path)
        hf.generation_config.eos_token_id = None
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
        assert output.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
