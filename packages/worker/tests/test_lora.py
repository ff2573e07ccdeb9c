"""LoRA adapters on the worker, driven by the engine core: greedy tokens equal transformers
running the PEFT-merged model in float32, alone and in batches mixing adapters and the base
model, under chunked prefill and preemption; adapters that cannot run are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from small_worker import SMALL_SETTINGS

from ember_scheduler import EngineCore, SamplingParams, SchedulerConfig
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.lora import LoRAConfig, LoRARequest
from ember_spec_decode import SpeculativeConfig
from ember_testing.tiny_lora import (
    ATTENTION,
    fused_lora_path,
    merged_hf_model,
    tiny_lora_path,
)
from ember_worker.executor import InProcessExecutor
from ember_worker.hf_config import load_hf_config
from ember_worker.lora import load_adapter
from ember_worker.models import DecoderConfig

pytest.importorskip("peft")

PROMPTS = [[1, 40, 41, 42, 50, 60], [7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 90, 17], [5, 6, 200, 4]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base):
    """Adapters of different ranks and modules: every projection at rank 8; q/v at rank 4 with
    rsLoRA; and an every-projection rank-4 adapter rewritten against fused projections (its
    reference is the unfused one, which means the same)."""
    unfused = tiny_lora_path(base, seed=3, r=4, lora_alpha=8)
    return {
        "all": (tiny_lora_path(base, seed=1, r=8, lora_alpha=16), None),
        "qv-rslora": (
            tiny_lora_path(
                base,
                seed=2,
                r=4,
                lora_alpha=4,
                target_modules=("q_proj", "v_proj"),
                use_rslora=True,
            ),
            None,
        ),
        "fused": (fused_lora_path(unfused), unfused),
    }


def _request(name: str, adapters) -> LoRARequest | None:
    if name == "base":
        return None
    index = list(adapters).index(name) + 1
    return LoRARequest(name, index, str(adapters[name][0]))


def _expected(base, adapters, name: str, prompt: list[int], cache: dict) -> list[int]:
    if name not in cache:
        if name == "base":
            from transformers import AutoModelForCausalLM

            cache[name] = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        else:
            path, reference = adapters[name]
            cache[name] = merged_hf_model(base, reference or path)
    hf = cache[name]
    hf.generation_config.eos_token_id = None  # plain argmax, as the engine without an EOS
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def _run(base, jobs, max_loras=3, max_cpu_loras=4, speculative_config=None, **settings):
    """Run ``jobs`` [(request id, prompt, LoRARequest or None)] to the end; returns the tokens
    per request and the ids of the requests preempted (or, with ``speculative_config``, that
    verified drafts)."""
    lora = LoRAConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras)
    settings = {**SMALL_SETTINGS, **settings}
    executor = InProcessExecutor(base, lora=lora, speculative_config=speculative_config, **settings)
    spec = speculative_config
    core = EngineCore(
        executor,
        SchedulerConfig(
            max_num_seqs=settings["max_num_seqs"],
            max_num_batched_tokens=settings["max_num_batched_tokens"],
            max_model_len=settings["max_model_len"],
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
            lora=lora,
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for rid, prompt, request in jobs:
        core.add_request(EngineCoreRequest(rid, prompt, params, lora_request=request))
    tokens = {rid: [] for rid, _, _ in jobs}
    preempted: set[str] = set()
    schedule = core.scheduler.schedule

    def schedule_and_watch():
        step = schedule()
        preempted.update(step.scheduled_spec_decode_tokens if spec else step.preempted_req_ids)
        return step

    core.scheduler.schedule = schedule_and_watch
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens, preempted


@pytest.mark.parametrize("name", ["all", "qv-rslora", "fused"])
def test_each_adapter_alone_matches_the_peft_merged_model(base, adapters, name):
    prompt = PROMPTS[0]
    tokens, _ = _run(base, [("r", prompt, _request(name, adapters))])
    assert tokens["r"] == _expected(base, adapters, name, prompt, {})


def test_a_batch_mixing_adapters_of_different_ranks_and_modules_and_the_base_model(base, adapters):
    names = ["all", "qv-rslora", "base", "fused"]
    jobs = [(n, p, _request(n, adapters)) for n, p in zip(names, PROMPTS)]
    tokens, _ = _run(base, jobs, max_loras=3)
    cache: dict = {}
    for name, prompt in zip(names, PROMPTS):
        assert tokens[name] == _expected(base, adapters, name, prompt, cache), name
    # The adapters changed the outputs: the base model's tokens differ from each adapter's.
    assert len({tuple(t) for t in tokens.values()}) == 4


def test_adapters_under_chunked_prefill_preemption_and_slot_eviction(base, adapters):
    """One slot for three adapters (each step runs one; the others wait and take the slot in
    turn), a host cache of two, prompts chunked by a 4-token budget and a KV cache too small for
    every request at once (preemption)."""
    names = ["all", "qv-rslora", "fused", "all", "base"]
    prompts = [*PROMPTS, [9, 9, 8, 8, 7]]
    jobs = [(f"{n}-{i}", p, _request(n, adapters)) for i, (n, p) in enumerate(zip(names, prompts))]
    tokens, preempted = _run(
        base,
        jobs,
        max_loras=1,
        max_cpu_loras=2,
        max_num_batched_tokens=4,
        kv_cache_memory=12 * 1024,
    )
    assert preempted
    cache: dict = {}
    for (rid, prompt, _), name in zip(jobs, names):
        assert tokens[rid] == _expected(base, adapters, name, prompt, cache), rid


def test_adapters_compose_with_ngram_speculative_decoding(base, adapters):
    """Drafts from the n-gram proposer are verified with each row's adapter: the tokens are
    the merged model's, and drafts were scheduled."""
    names = ["all", "base", "qv-rslora"]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 9, 8, 9], [4, 4, 4, 4, 4, 4]]
    jobs = [(n, p, _request(n, adapters)) for n, p in zip(names, prompts)]
    ngram = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)
    tokens, verified = _run(base, jobs, speculative_config=ngram)
    cache: dict = {}
    for name, prompt in zip(names, prompts):
        assert tokens[name] == _expected(base, adapters, name, prompt, cache), name
    assert verified


def test_decode_steps_with_adapters_run_the_compiled_stack(base, adapters, monkeypatch):
    """Decode steps mixing adapters and the base model run the compiled CPU decoder stack with
    per-token adapter slots, and give the per-layer path's tokens."""
    from ember_kernels import cpu_ops
    from ember_worker.models import cpu_stack, decoder

    if not cpu_ops.available():
        pytest.skip("no C++ compiler here")
    names = ["all", "qv-rslora", "base", "fused"]
    jobs = [(n, p, _request(n, adapters)) for n, p in zip(names, PROMPTS)]
    forward, slotted = cpu_stack.LoRADecoderStack.forward, []

    def watched(self, *args):
        if self.step.mapping is not None:
            slotted.append(self.step.mapping.slot_indices.tolist())
        return forward(self, *args)

    monkeypatch.setattr(cpu_stack.LoRADecoderStack, "forward", watched)
    stacked, _ = _run(base, jobs)
    assert any(len(set(s)) == 4 for s in slotted)  # three adapters and the base in one step
    monkeypatch.setattr(decoder, "build_cpu_stack", lambda layers: None)
    per_layer, _ = _run(base, jobs)
    assert stacked == per_layer


def _config(base) -> DecoderConfig:
    return DecoderConfig.from_hf_config(load_hf_config(base))


def test_adapters_that_cannot_run_are_refused_naming_adapter_and_field(base, tiny_model, tmp_path):
    config = _config(base)
    big = tiny_lora_path(base, seed=4, r=32, lora_alpha=32, target_modules=ATTENTION)
    with pytest.raises(ValueError, match=r"'big'.*\br: rank 32 is above max_lora_rank 16"):
        load_adapter(LoRARequest("big", 1, str(big)), config, 16, torch.float32)
    head = tiny_lora_path(base, seed=5, r=4, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match=r"'head'.*target_modules"):
        load_adapter(LoRARequest("head", 2, str(head)), config, 16, torch.float32)
    other_base = tiny_model("llama", hidden_size=96, intermediate_size=128)
    other = tiny_lora_path(other_base, seed=6, r=4, target_modules=("q_proj",))
    with pytest.raises(ValueError, match=r"'other'.*base_model_name_or_path"):
        load_adapter(LoRARequest("other", 3, str(other)), config, 16, torch.float32)
    dora = tmp_path / "dora"
    shutil.copytree(tiny_lora_path(base, seed=7, r=4, target_modules=("q_proj",)), dora)
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(ValueError, match=r"'dora'.*use_dora"):
        load_adapter(LoRARequest("dora", 4, str(dora)), config, 16, torch.float32)
    with pytest.raises(ValueError, match=r"'missing'.*lora_path"):
        load_adapter(
            LoRARequest("missing", 5, str(tmp_path / "nowhere")), config, 16, torch.float32
        )


def test_a_lora_request_on_a_worker_without_lora_is_refused(base, adapters):
    from ember_scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput

    executor = InProcessExecutor(base, **SMALL_SETTINGS)
    new = NewRequestData(
        "r",
        [1, 2, 3],
        [],
        SamplingParams(max_tokens=2),
        [0],
        0,
        lora_request=_request("all", adapters),
    )
    step = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"r": 3},
        total_num_scheduled_tokens=3,
    )
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        executor.execute_model(step)
