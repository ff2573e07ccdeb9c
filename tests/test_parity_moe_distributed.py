"""Mixture-of-experts models over two ranks against transformers: tensor parallel (every expert's
intermediate dimension split), expert parallel (``enable_expert_parallel``: half the experts,
whole, per rank, contiguous or dealt round-robin; tokens dispatched by all-to-all) and two
pipeline stages, worker processes and Ray actors.

Greedy tokens equal transformers' with whole prompts, under preemption (asserted), with chunked
prefill and over a warm prefix cache (hits asserted); logprobs within 1e-4. The default suite runs
DeepSeek-V3 under TP (latent attention's heads split, the latent cache replicated) and Qwen2-MoE
(shared expert, a dense layer) under EP, both over worker processes; the slow session every
architecture on every layout, Ray included.
"""

from __future__ import annotations

import pytest
from test_parity import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_PROMPTS,
    assert_matches_hf,
    greedy,
    model_path,
    parity_prompts,
)
from test_parity_distributed import engine, run_to_end, suite_params
from test_parity_sampling import NUM_LOGPROBS, _check_rows, _hf_log_softmax

from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_models import MOE_ARCHITECTURES
from ember_worker.distributed.groups import ParallelConfig
from ember_worker.distributed.worker import WorkerConfig
from ember_worker.executor_factory import make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYOUTS = {
    "tp2": (ParallelConfig(tensor_parallel_size=2), "mp"),
    "tp2-ep": (ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), "mp"),
    "tp2-ep-round-robin": (
        ParallelConfig(
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            expert_placement_strategy="round_robin",
        ),
        "mp",
    ),
    "ray-tp2-ep": (ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), "ray"),
    "pp2": (ParallelConfig(pipeline_parallel_size=2), "mp"),
}
IN_DEFAULT_SUITE = {("deepseek_v3", "tp2"), ("qwen2_moe", "tp2-ep")}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024**2)
    yield
    ray.shutdown()


@pytest.fixture(
    scope="module",
    params=suite_params(
        [(arch, layout) for layout in LAYOUTS for arch in MOE_ARCHITECTURES], IN_DEFAULT_SUITE
    ),
)
def parallel(request):
    arch, layout = request.param
    parallel_config, backend = LAYOUTS[layout]
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config = WorkerConfig(
        str(model_path(arch)),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=512,
        block_size=BLOCK_SIZE,
        kv_cache_memory=8 * 1024**2,
        num_threads=1,
        parallel=parallel_config,
    )
    executor = make_executor(config, backend)
    yield arch, executor
    executor.shutdown()


def test_greedy_matches_transformers_whole_preempted_chunked_and_cached(parallel):
    arch, executor = parallel
    prompts = parity_prompts()
    outputs, totals = run_to_end(engine(executor), prompts, greedy, "ample-")
    assert totals["num_preemptions"] == 0
    assert_matches_hf(arch, outputs)
    outputs, totals = run_to_end(engine(executor, num_blocks=40), prompts, greedy, "pre-")
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)
    core = engine(executor, max_num_batched_tokens=24)
    outputs, _ = run_to_end(core, prompts, greedy, "chunk-")
    assert_matches_hf(arch, outputs)
    core = engine(executor, caching=True)
    run_to_end(core, prompts, greedy, "first-")
    outputs, totals = run_to_end(core, prompts, greedy, "second-")
    assert totals["prefix_cache_hits"] > 0
    assert_matches_hf(arch, outputs)


def test_logprobs_match_transformers(parallel):
    arch, executor = parallel
    prompts = [parity_prompts()[i] for i in (15, 3, 11)]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS,
    )  # fmt: skip
    core = engine(executor, max_num_batched_tokens=24)
    outputs, _ = run_to_end(core, prompts, lambda _i: params, "logprobs-")
    for i, prompt in enumerate(prompts):
        got = outputs[i]
        reference = _hf_log_softmax(arch, prompt + got["tokens"])
        _check_rows(got["prompt_logprobs"], reference[: len(prompt) - 1], prompt[1:])
        _check_rows(got["logprobs"], reference[len(prompt) - 1 : -1], got["tokens"])
