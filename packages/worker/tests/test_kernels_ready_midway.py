"""On a first start the compiled CPU kernels are built in the background while the torch path
serves (``ember_kernels.cpu_ops.start_background_build``): an engine takes them up between two
steps, never inside one, with greedy tokens unchanged."""

from __future__ import annotations

import pytest
import torch
from small_worker import SMALL_SETTINGS

from ember_kernels import cpu_ops
from ember_scheduler import EngineCore, SamplingParams, SchedulerConfig
from ember_scheduler.engine_types import EngineCoreRequest
from ember_worker.executor import InProcessExecutor
from ember_worker.models.decoder import DecoderModel

MAX_TOKENS = 8
PROMPTS = {"a": [5, 17, 99, 3, 250, 42, 7], "b": [300, 12, 8]}
READY_AT_STEP = 3  # the library's build finishes while the engine is at this step


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
def test_kernels_ready_midway_are_taken_up_between_steps(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    library = cpu_ops.load_library()
    asked = []  # one entry per question "is the build done?"

    def settled_library():
        asked.append(None)
        return library if len(asked) >= READY_AT_STEP else None

    stacks = []  # per forward: whether the compiled stack ran
    stack_for = DecoderModel._stack_for

    def watched_stack_for(self, metadata):
        stack = stack_for(self, metadata)
        stacks.append(stack is not None)
        return stack

    # The process as after ``start_background_build`` on an empty cache.
    monkeypatch.setattr(cpu_ops, "building_in_background", lambda: True)
    monkeypatch.setattr(cpu_ops, "settled_library", settled_library)
    monkeypatch.setattr(DecoderModel, "_stack_for", watched_stack_for)
    settings = {**SMALL_SETTINGS, "max_num_batched_tokens": 4}  # prefills over several steps
    executor = InProcessExecutor(path, **settings)
    config = SchedulerConfig(
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        max_model_len=settings["max_model_len"],
    )
    core = EngineCore(executor, config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for rid, prompt in PROMPTS.items():
        core.add_request(EngineCoreRequest(rid, prompt, params))
    tokens = {rid: [] for rid in PROMPTS}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids

    # Each step asked once and kept its answer: torch path, then the compiled stack throughout.
    assert len(asked) == len(stacks)
    assert stacks == [False] * (READY_AT_STEP - 1) + [True] * (len(stacks) - READY_AT_STEP + 1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    for rid, prompt in PROMPTS.items():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
        assert tokens[rid] == out[0, len(prompt) :].tolist(), rid
