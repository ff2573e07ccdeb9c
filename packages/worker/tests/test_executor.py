"""The executor and model runner, driven by hand-written SchedulerOutputs."""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch
from small_worker import BLOCK_SIZE, SMALL_SETTINGS
from transformers import AutoModelForCausalLM

from ember_scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.executor import InProcessExecutor
from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache, copy_kv_blocks
from ember_worker.step_threads import StepThreads

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def _executor(path, **kwargs):
    return InProcessExecutor(path, **{**SMALL_SETTINGS, **kwargs})


def _step(new=(), cached=(), scheduled=None, finished=()):
    scheduled = scheduled or {}
    cached_data = CachedRequestData(
        req_ids=[c[0] for c in cached],
        new_block_ids=[c[1] for c in cached],
        num_computed_tokens=[c[2] for c in cached],
    )
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_data,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
    )


def _hf_greedy(path, prompt, n):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # plain argmax, EOS included, as the runner
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_kv_blocks_come_from_the_memory_budget(llama):
    executor = _executor(llama, kv_cache_memory=1 << 20)
    spec = executor.model_runner.kv_cache_spec
    # 2 layers x (key + value) x 4 slots x 2 kv heads x 16 dims x 4 bytes
    assert spec.bytes_per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert executor.num_kv_blocks == (1 << 20) // spec.bytes_per_block
    assert executor.block_size == BLOCK_SIZE
    for cache in executor.model_runner.kv_caches[0]:
        assert cache.shape == (executor.num_kv_blocks, BLOCK_SIZE, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_cache_is_zero_aligned_and_one_tensor_per_layer_and_side(dtype):
    spec = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_size=8, dtype=dtype)
    caches = allocate_kv_cache(spec, 5, torch.device("cpu"))
    tensors = [t for pair in caches for t in pair]
    assert len(tensors) == 6
    for t in tensors:
        assert t.shape == (5, 4, 2, 8) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0 and not t.any()
    tensors[0].fill_(1)  # writing one leaves every other untouched
    assert all(not t.any() for t in tensors[1:])


def test_block_copies_run_in_order_on_every_layer():
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    caches = allocate_kv_cache(spec, 6, torch.device("cpu"))
    for layer, (key, value) in enumerate(caches):
        for block in range(6):
            key[block] = 100 * layer + block
            value[block] = -(100 * layer + block)
    # Block 2 is a source, then a target: block 3 gets its old contents.
    copy_kv_blocks(caches, [(2, 3), (5, 2)])
    for layer, (key, value) in enumerate(caches):
        got = [int(key[block, 0, 0, 0]) - 100 * layer for block in range(6)]
        assert got == [0, 1, 5, 2, 4, 5]
        assert torch.equal(value, -key)


def _mapping_flags(address: int) -> set[str]:
    """The VmFlags of this process's memory mapping that holds ``address`` (Linux smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:  # a mapping's header line: start-end ...
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's smaps")
def test_cpu_kv_cache_asks_for_no_huge_pages():
    # A first touch on a huge page maps 2 MiB at once: it stalled cold prefills for tens of ms.
    spec = KVCacheSpec(
        num_layers=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    (key, _), _ = allocate_kv_cache(spec, 2048, torch.device("cpu"))  # 32 MiB
    assert "nh" in _mapping_flags(key.data_ptr())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(kv_cache_memory=None), ValueError, "kv_cache_memory"),
        (dict(kv_cache_memory=100), ValueError, "holds no KV block"),
        (dict(max_model_len=4096), ValueError, "max_model_len"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(num_threads=0), ValueError, "num_threads"),
    ],
)
def test_bad_settings_are_named(llama, kwargs, error, match):
    with pytest.raises(error, match=match):
        _executor(llama, **kwargs)


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt(llama):
    executor = _executor(llama)
    prompt = list(range(10, 30))  # 20 tokens: chunks of 12 and 8
    new = NewRequestData("a", prompt, [], GREEDY, block_ids=[0, 1, 2], num_computed_tokens=0)
    out = executor.execute_model(_step(new=[new], scheduled={"a": 12}))
    assert out.req_ids == ["a"]
    assert out.sampled_token_ids == [[]]
    out = executor.execute_model(_step(cached=[("a", [3, 4], 12)], scheduled={"a": 8}))
    tokens = out.sampled_token_ids[0]
    assert len(tokens) == 1
    for computed in range(20, 24):
        new_blocks = [5] if computed == 20 else []
        out = executor.execute_model(
            _step(cached=[("a", new_blocks, computed)], scheduled={"a": 1})
        )
        tokens += out.sampled_token_ids[0]
    assert tokens == _hf_greedy(llama, prompt, 5)


def test_finished_request_leaves_and_another_takes_its_place(llama):
    executor = _executor(llama)
    a = NewRequestData("a", [5, 6, 7], [], GREEDY, block_ids=[0], num_computed_tokens=0)
    b = NewRequestData("b", [8, 9], [], GREEDY, block_ids=[1], num_computed_tokens=0)
    out = executor.execute_model(_step(new=[a, b], scheduled={"a": 3, "b": 2}))
    assert [len(t) for t in out.sampled_token_ids] == [1, 1]
    c = NewRequestData("c", [11, 12, 13, 14], [], GREEDY, block_ids=[2], num_computed_tokens=0)
    out = executor.execute_model(
        _step(new=[c], cached=[("b", [], 2)], scheduled={"b": 1, "c": 4}, finished=["a"])
    )
    assert set(out.req_ids) == {"b", "c"}
    assert out.sampled_token_ids[out.req_id_to_index["c"]] == _hf_greedy(llama, [11, 12, 13, 14], 1)


def test_resumed_request_continues_from_its_output_tokens(llama):
    """A preempted request comes back as new, with its outputs so far, and recomputes them."""
    executor = _executor(llama)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = _hf_greedy(llama, prompt, 4)
    new = NewRequestData("r", prompt, expected[:3], GREEDY, [7, 8, 9], num_computed_tokens=0)
    out = executor.execute_model(_step(new=[new], scheduled={"r": 11}))
    assert out.sampled_token_ids == [[expected[3]]]


def test_logprobs_rows_follow_the_sampled_tokens(llama):
    executor = _executor(llama)
    asks = SamplingParams(temperature=0.0, logprobs=3)
    a = NewRequestData("a", [5, 6, 7], [], GREEDY, block_ids=[0], num_computed_tokens=0)
    b = NewRequestData("b", [8, 9], [], asks, block_ids=[1], num_computed_tokens=0)
    out = executor.execute_model(_step(new=[a, b], scheduled={"a": 3, "b": 2}))
    assert len(out.logprobs.ranks) == 2
    row_a, row_b = out.req_id_to_index["a"], out.req_id_to_index["b"]
    assert out.logprobs.token_ids[row_a] == []
    assert out.logprobs.token_ids[row_b][0] == out.sampled_token_ids[row_b][0]
    assert len(out.logprobs.token_ids[row_b]) == 4
    assert out.logprobs.ranks[row_b] == 1


def test_bfloat16_executor_runs_its_cache_in_bfloat16(llama):
    executor = _executor(llama, dtype="bfloat16")
    assert executor.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    # Twice the blocks of float32 from the same budget.
    assert executor.num_kv_blocks == (1 << 20) // (2 * 2 * BLOCK_SIZE * 2 * 16 * 2)
    prompt = [5, 6, 7, 8, 9]
    new = NewRequestData("a", prompt, [], GREEDY, block_ids=[0, 1], num_computed_tokens=0)
    out = executor.execute_model(_step(new=[new], scheduled={"a": 5}))
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    # bfloat16 rounding may reorder near-ties: the pick is among transformers' top few.
    assert out.sampled_token_ids[0][0] in logits.topk(3).indices.tolist()


def test_a_running_request_left_out_of_a_step_keeps_its_state(llama):
    """The token budget may skip a running request for a step; it samples nothing then."""
    executor = _executor(llama)
    a = NewRequestData("a", [5, 6, 7], [], GREEDY, block_ids=[0], num_computed_tokens=0)
    b = NewRequestData("b", [8, 9, 10, 11], [], GREEDY, block_ids=[1, 2], num_computed_tokens=0)
    out = executor.execute_model(_step(new=[a, b], scheduled={"a": 3, "b": 4}))
    b_tokens = list(out.sampled_token_ids[out.req_id_to_index["b"]])
    out = executor.execute_model(_step(cached=[("a", [], 3)], scheduled={"a": 1}))
    assert out.sampled_token_ids[out.req_id_to_index["b"]] == []
    assert len(out.sampled_token_ids[out.req_id_to_index["a"]]) == 1
    out = executor.execute_model(_step(cached=[("b", [], 4)], scheduled={"b": 1}))
    b_tokens += out.sampled_token_ids[out.req_id_to_index["b"]]
    assert b_tokens == _hf_greedy(llama, [8, 9, 10, 11], 2)


def test_execute_after_shutdown_is_refused(llama):
    executor = _executor(llama)
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        executor.execute_model(_step())


def test_each_step_runs_with_the_threads_of_its_phase_in_the_thread_that_runs_it(llama):
    # 2 threads for steps of 8 tokens or more, else 1; the steps run in
    # another Python thread, whose OpenMP thread count starts at the default, not at what this
    # thread set.
    executor = _executor(llama, num_threads=StepThreads(2, 1, large_min_tokens=8))
    seen = []
    forward = executor.model_runner.model.forward

    def recording_forward(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    executor.model_runner.model.forward = recording_forward
    a = NewRequestData("a", list(range(10, 22)), [], GREEDY, [0, 1, 2, 3], num_computed_tokens=0)
    b = NewRequestData("b", list(range(30, 42)), [], GREEDY, [4, 5, 6, 7], num_computed_tokens=0)
    steps = [
        _step(new=[a], scheduled={"a": 12}),
        _step(cached=[("a", [], 12)], scheduled={"a": 1}),
        _step(new=[b], cached=[("a", [], 13)], scheduled={"a": 1, "b": 12}),
    ]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for step in steps:
            pool.submit(executor.execute_model, step).result()
    assert seen == [2, 1, 2]  # a's prefill; a's decode; b's prefill beside a's decode


def test_step_threads_must_be_positive():
    with pytest.raises(ValueError, match="small_num_threads"):
        StepThreads(2, 0)
