"""Tensor and pipeline parallel (worker processes and Ray actors) against transformers and TP=1.

Each (architecture, layout) starts its ranks once for the whole module; its runs share them. A
run sees the executor through ``BlockView``, which offers the scheduler only the first N of the
ranks' KV blocks, so that one executor serves the ample, preemption and chunked-prefill runs.
The default suite runs one architecture per layout; the slow session runs all four for each.
"""

from __future__ import annotations

import pytest
import torch
from test_parity import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_PROMPTS,
    assert_matches_hf,
    greedy,
    make_engine,
    model_path,
    parity_prompts,
    run,
)
from test_parity_sampling import NUM_LOGPROBS, _check_rows, _hf_log_softmax

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.sampling_params import SamplingParams
from ember_spec_decode import SpeculativeConfig
from ember_testing.tiny_models import ARCHITECTURES
from ember_worker.distributed.groups import ParallelConfig
from ember_worker.distributed.worker import WorkerConfig
from ember_worker.executor_factory import make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYOUTS = {
    "tp2": (ParallelConfig(tensor_parallel_size=2), "mp"),
    "pp2": (ParallelConfig(pipeline_parallel_size=2), "mp"),
    "ray-tp2": (ParallelConfig(tensor_parallel_size=2), "ray"),
}
IN_DEFAULT_SUITE = {("llama", "tp2"), ("qwen3", "pp2"), ("qwen2", "ray-tp2")}
MAX_BATCHED_TOKENS = 512


class BlockView:
    """An executor whose scheduler may use only its first ``num_blocks`` KV blocks."""

    def __init__(self, executor, num_blocks: int) -> None:
        assert num_blocks <= executor.num_kv_blocks
        self.executor = executor
        self.num_kv_blocks = num_blocks
        self.block_size = executor.block_size
        self.vocab_size = executor.vocab_size

    def execute_model(self, scheduler_output, non_block=False):
        return self.executor.execute_model(scheduler_output, non_block)

    def shutdown(self) -> None:
        """The ranks outlive one engine; the module's fixture stops them."""


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # Logical CPUs for two 2-rank executors: the last ``parallel`` and the first ``speculative``
    # fixture instance (both module-scoped) are alive together when pytest moves between them.
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 1024**2)
    yield
    ray.shutdown()


def suite_params(cases, in_default_suite) -> list:
    """pytest params of ``cases`` (tuples of names), slow-marked unless in ``in_default_suite``."""
    return [
        pytest.param(
            case, id="-".join(case), marks=() if case in in_default_suite else pytest.mark.slow
        )
        for case in cases
    ]


def start_executor(request, arch: str, layout: str, speculative_config=None):
    """An executor of ``layout`` over ``arch``'s tiny model (Ray started first where needed)."""
    parallel_config, backend = LAYOUTS[layout]
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config = WorkerConfig(
        str(model_path(arch)),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        block_size=BLOCK_SIZE,
        kv_cache_memory=8 * 1024**2,
        num_threads=1,
        parallel=parallel_config,
        speculative_config=speculative_config,
    )
    return make_executor(config, backend)


@pytest.fixture(
    scope="module",
    params=suite_params(
        [(arch, layout) for layout in LAYOUTS for arch in ARCHITECTURES], IN_DEFAULT_SUITE
    ),
)
def parallel(request):
    arch, layout = request.param
    executor = start_executor(request, arch, layout)
    yield arch, executor
    executor.shutdown()


def engine(
    executor,
    num_blocks=512,
    max_num_batched_tokens=MAX_BATCHED_TOKENS,
    caching=False,
    async_scheduling=False,
):
    config = SchedulerConfig(
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=caching,
        async_scheduling=async_scheduling,
    )
    return EngineCore(BlockView(executor, num_blocks), config)


def run_to_end(core: EngineCore, prompts, params_of, prefix: str):
    """``run``, then hand the workers the last finished ids (as the next step would), so that
    the next engine on the same ranks starts from an empty batch."""
    outputs, totals = run(core, prompts, params_of, prefix)
    core.executor.execute_model(core.scheduler.schedule())
    return outputs, totals


def test_greedy_matches_transformers(parallel):
    arch, executor = parallel
    outputs, totals = run_to_end(engine(executor), parity_prompts(), greedy, "ample-")
    assert totals["num_preemptions"] == 0 and totals["max_running"] == NUM_PROMPTS
    assert_matches_hf(arch, outputs)


def test_greedy_matches_transformers_under_preemption(parallel):
    arch, executor = parallel
    outputs, totals = run_to_end(engine(executor, num_blocks=40), parity_prompts(), greedy, "pre-")
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)


def test_greedy_matches_transformers_with_chunked_prefill(parallel):
    arch, executor = parallel
    core = engine(executor, max_num_batched_tokens=24)
    outputs, _ = run_to_end(core, parity_prompts(), greedy, "chunk-")
    assert_matches_hf(arch, outputs)


def test_greedy_matches_transformers_with_async_scheduling(parallel):
    """Steps sent to the ranks before the previous one's output came back: in order, exact."""
    arch, executor = parallel
    core = engine(executor, num_blocks=40, max_num_batched_tokens=24, async_scheduling=True)
    outputs, totals = run_to_end(core, parity_prompts(), greedy, "async-")
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)


def test_greedy_matches_transformers_with_prefix_caching(parallel):
    """Prompts sharing prefixes, then the same prompts again: answered with one token first,
    each leaves its last, partly filled block cached, so the second pass finds all but each
    prompt's last token, whole blocks shared and the tail copied on every rank."""
    arch, executor = parallel
    core = engine(executor, caching=True)
    prompts = parity_prompts()
    _, totals_first = run_to_end(core, prompts, lambda i: greedy(i, 1), "first-")
    second, totals_second = run_to_end(core, prompts, greedy, "second-")
    assert totals_first["prefix_cache_hits"] > 0
    assert totals_second["prefix_cache_hits"] == sum(len(p) - 1 for p in prompts)
    assert_matches_hf(arch, second)


def test_logprobs_match_one_rank_and_transformers(parallel):
    arch, executor = parallel
    prompts = [parity_prompts()[i] for i in (15, 3, 11)]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS,
    )  # fmt: skip
    core = engine(executor, max_num_batched_tokens=24)
    outputs, _ = run_to_end(core, prompts, lambda _i: params, "logprobs-")
    one_rank, _ = run(make_engine(arch, max_num_batched_tokens=24), prompts, lambda _i: params)
    for i, prompt in enumerate(prompts):
        got, want = outputs[i], one_rank[i]
        assert got["tokens"] == want["tokens"]
        for key in ("logprobs", "prompt_logprobs"):
            assert [r.token_ids for r in got[key]] == [r.token_ids for r in want[key]]
            for a, b in zip(got[key], want[key]):
                torch.testing.assert_close(
                    torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
                )
        reference = _hf_log_softmax(arch, prompt + got["tokens"])
        _check_rows(got["prompt_logprobs"], reference[: len(prompt) - 1], prompt[1:])
        _check_rows(got["logprobs"], reference[len(prompt) - 1 : -1], got["tokens"])


# Speculative decoding on the same layouts: prompt lookup, and the target as its own (replicated)
# draft model, whose drafts must all be accepted. Every rank feeds the same drafts: under TP each
# rank verifies and proposes alike, under PP the last stage sends tokens and drafts to the others.
SPECULATIVE = {
    "ngram": SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3),
    "draft-model": SpeculativeConfig("draft_model", 3, model=str(model_path("llama"))),
}
SPEC_IN_DEFAULT_SUITE = {("tp2", "ngram"), ("pp2", "draft-model"), ("ray-tp2", "ngram")}


@pytest.fixture(
    scope="module",
    params=suite_params(
        [(layout, proposer) for layout in LAYOUTS for proposer in SPECULATIVE],
        SPEC_IN_DEFAULT_SUITE,
    ),
)
def speculative(request):
    layout, proposer = request.param
    executor = start_executor(request, "llama", layout, SPECULATIVE[proposer])
    yield SPECULATIVE[proposer], executor
    executor.shutdown()


def spec_engine(executor, spec: SpeculativeConfig, async_scheduling: bool) -> EngineCore:
    """A small pool and step budget: preemption and chunked prefill while speculating."""
    config = SchedulerConfig(
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=40,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
        num_lookahead_tokens=spec.num_lookahead_tokens,
        num_speculative_tokens=spec.num_speculative_tokens,
        async_scheduling=async_scheduling,
    )
    return EngineCore(BlockView(executor, 40), config)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculative_greedy_matches_transformers(speculative, async_scheduling):
    spec, executor = speculative
    core = spec_engine(executor, spec, async_scheduling)
    prefix = f"spec-{async_scheduling}-"
    outputs, totals = run_to_end(core, parity_prompts(), greedy, prefix)
    assert totals["num_preemptions"] > 0
    assert totals["num_accepted_tokens"] > 0
    if spec.method == "draft_model":  # the target drafting for itself
        assert totals["num_accepted_tokens"] == totals["num_draft_tokens"]
    assert_matches_hf("llama", outputs)
