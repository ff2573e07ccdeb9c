"""LoRA through the offline API, as vLLM's: ``LLM(..., enable_lora=True, max_loras=...)`` and
``generate(..., lora_request=LoRARequest(name, id, path))`` one for all prompts or one per
prompt. Greedy tokens equal transformers running the PEFT-merged model in float32; a prefix
shared by two adapters is not reused across them; bad adapters are refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember import LLM, LoRARequest, SamplingParams
from ember_testing.tiny_lora import merged_hf_model, tiny_lora_path
from ember_testing.tiny_models import tiny_model_path

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[1, 40, 41, 42, 50, 60, 61], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 90, 17, 5]]


@pytest.fixture(scope="module")
def base():
    return tiny_model_path("qwen2")


@pytest.fixture(scope="module")
def loras(base):
    return [
        LoRARequest("sql", 1, str(tiny_lora_path(base, seed=11, r=8, lora_alpha=16))),
        LoRARequest(
            "chat",
            2,
            str(
                tiny_lora_path(
                    base, seed=12, r=2, lora_alpha=4, target_modules=("v_proj", "down_proj")
                )
            ),
        ),
    ]


def _reference(base, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    if lora is None:
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        hf = merged_hf_model(base, lora.lora_path)
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _llm(base, **kwargs) -> LLM:
    settings = dict(
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_cpu_loras=2,
        max_model_len=128,
        kv_cache_memory=4 * 1024**2,
        block_size=4,
    )
    return LLM(str(base), **{**settings, **kwargs})


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_adapters_and_base_in_one_batch_match_the_merged_models(
    base, loras, async_scheduling
):
    llm = _llm(base, async_scheduling=async_scheduling)
    requests = [loras[0], loras[1], None]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=requests, use_tqdm=False
    )
    for output, prompt, lora in zip(outputs, PROMPTS, requests):
        assert output.outputs[0].token_ids == _reference(base, lora, prompt)
    # One adapter for every prompt.
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]],
        GREEDY,
        lora_request=loras[1],
        use_tqdm=False,
    )
    for output, prompt in zip(outputs, PROMPTS[:2]):
        assert output.outputs[0].token_ids == _reference(base, loras[1], prompt)


def test_adapters_under_chunked_prefill_and_preemption(base, loras):
    llm = _llm(
        base, max_loras=1, max_num_batched_tokens=8, max_model_len=40, kv_cache_memory=24 * 1024
    )
    preempted: set[str] = set()
    scheduler = llm.engine_core.scheduler
    schedule = scheduler.schedule

    def schedule_and_watch():
        step = schedule()
        preempted.update(step.preempted_req_ids)
        return step

    scheduler.schedule = schedule_and_watch
    prompts = PROMPTS * 2
    requests = [loras[0], loras[1], None, loras[1], None, loras[0]]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests, use_tqdm=False
    )
    for output, prompt, lora in zip(outputs, prompts, requests):
        assert output.outputs[0].token_ids == _reference(base, lora, prompt)
    assert preempted


def test_a_prefix_shared_by_two_adapters_is_not_reused_across_them(base, loras):
    llm = _llm(base)
    prompt = [{"prompt_token_ids": list(range(20, 40))}]
    first = llm.generate(prompt, GREEDY, lora_request=loras[0], use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, lora_request=loras[1], use_tqdm=False)[0]
    base_run = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, lora_request=loras[0], use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0
    assert base_run.num_cached_tokens == 0
    assert again.num_cached_tokens == 19  # every prompt token but the last
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_lora_requests_that_cannot_run_are_refused(base, loras, tmp_path):
    plain = LLM(str(base), dtype="float32", max_model_len=64, kv_cache_memory=1024**2)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", GREEDY, lora_request=loras[0], use_tqdm=False)
    llm = _llm(base, max_lora_rank=4)
    with pytest.raises(ValueError, match=r"'sql'.*\br: rank 8 is above max_lora_rank 4"):
        llm.generate("hi", GREEDY, lora_request=loras[0], use_tqdm=False)
    llm.generate("hi", GREEDY, lora_request=[loras[1]], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 2 already names"):
        llm.generate(
            "hi", GREEDY, lora_request=LoRARequest("x", 2, loras[0].lora_path), use_tqdm=False
        )
    with pytest.raises(ValueError, match="lora_request must be one value or one per prompt"):
        llm.generate(["a", "b"], GREEDY, lora_request=[loras[1]], use_tqdm=False)


def test_adapters_compose_with_structured_outputs(base, loras):
    from ember import StructuredOutputsParams

    llm = _llm(base)
    choices = ["alpha", "beta gamma", "delta"]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outputs = llm.generate(
        ["pick one:", "another:", "base:"], params, lora_request=[loras[0], loras[1], None],
        use_tqdm=False,
    )  # fmt: skip
    assert all(output.outputs[0].text in choices for output in outputs)
    replies = llm.chat(
        [{"role": "user", "content": "hi"}], params, lora_request=loras[0], use_tqdm=False
    )
    assert replies[0].outputs[0].text in choices
