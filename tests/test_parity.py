"""Engine vs Hugging Face transformers: EngineCore + scheduler + worker, end to end.

Greedy tokens must equal transformers' token for token in float32, for every architecture, with
ample KV memory, with a KV pool small enough to force preemption, with prompts chunked by a small
token budget, with prefix caching over prompts that share long prefixes (a second run reusing
the cache), and with a sliding window shorter than the prompts. Every reference continuation
holds several distinct tokens, so that matching it says something. Logprobs must match transformers' log-softmax; seeded sampling must be reproducible
and independent of the rest of the batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_spec_decode import SpeculativeConfig
from ember_testing.tiny_models import ARCHITECTURES, tiny_model_path
from ember_worker.executor import InProcessExecutor

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
NUM_PROMPTS = 16
OUTPUT_LEN = 64
# A reference that repeats a token or two could be matched by an engine that gets most of the
# model wrong.
MIN_DISTINCT_TOKENS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def parity_prompts(seed: int = 0) -> list[list[int]]:
    """16 prompts of mixed length (5 to ~110 tokens); 10 of them in 3 groups sharing a prefix of
    48-64 tokens (3-4 full KV blocks), the rest unrelated."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 2000, (n,), generator=gen).tolist()

    prefixes = [tokens(48), tokens(64), tokens(50)]
    prompts = []
    for i in range(10):
        prompts.append(prefixes[i % 3] + tokens(int(torch.randint(1, 45, (1,), generator=gen))))
    for n in (5, 9, 17, 33, 70, 110):
        prompts.append(tokens(n))
    return prompts


# A model under test: (arch, config overrides as sorted items), hashable for caching.
ModelKey = tuple[str, tuple[tuple[str, object], ...]]


def model_path(model: str | ModelKey):
    arch, overrides = (model, ()) if isinstance(model, str) else model
    return tiny_model_path(arch, **dict(overrides))


@functools.cache
def hf_model(model: str | ModelKey):
    hf = AutoModelForCausalLM.from_pretrained(model_path(model), dtype=torch.float32).eval()
    # Plain argmax for max_new_tokens steps, as the engine's ignore_eos (min_new_tokens would
    # instead mask EOS and pick the runner-up where EOS wins).
    hf.generation_config.eos_token_id = None
    return hf


@functools.cache
def hf_greedy(
    model_key: str | ModelKey, prompt_seed: int = 0, output_len: int = OUTPUT_LEN
) -> tuple[tuple[int, ...], ...]:
    model = hf_model(model_key)
    outputs = []
    with torch.no_grad():
        for prompt in parity_prompts(prompt_seed):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                max_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(tuple(out[0, len(prompt) :].tolist()))
    return tuple(outputs)


def bytes_per_block(model: str | ModelKey) -> int:
    c = AutoConfig.from_pretrained(model_path(model))
    if getattr(c, "kv_lora_rank", None):  # MLA: one latent per token and layer
        return c.num_hidden_layers * BLOCK_SIZE * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * BLOCK_SIZE * c.num_key_value_heads * head_dim * 4


def make_engine(
    model: str | ModelKey,
    *,
    num_blocks: int = 512,
    max_num_batched_tokens: int = 512,
    prefix_caching=False,
    speculative_config: SpeculativeConfig | None = None,
    async_scheduling: bool = False,
) -> EngineCore:
    executor = InProcessExecutor(
        model_path(model),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * bytes_per_block(model),
        seed=0,
        speculative_config=speculative_config,
    )
    if speculative_config is None or speculative_config.method != "draft_model":
        assert executor.num_kv_blocks == num_blocks  # a draft model's KV shares the budget
    config = SchedulerConfig(
        max_num_seqs=NUM_PROMPTS,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=prefix_caching,
        num_lookahead_tokens=speculative_config.num_lookahead_tokens if speculative_config else 0,
        num_speculative_tokens=(
            speculative_config.num_speculative_tokens if speculative_config else 0
        ),
        async_scheduling=async_scheduling,
    )
    return EngineCore(executor, config, executor.grammar_compiler)


def run(core: EngineCore, prompts, params_of, prefix: str = "") -> tuple[dict, dict]:
    """Generate all prompts to completion; returns (outputs by index, summed scheduler stats)."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{prefix}{i}", prompt, params_of(i), eos_token_id=2))
    outputs: dict[int, dict] = {
        i: {"tokens": [], "logprobs": [], "prompt_logprobs": []} for i in range(len(prompts))
    }
    totals = {
        "num_preemptions": 0,
        "prefix_cache_hits": 0,
        "max_running": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
    }
    while core.has_unfinished_requests():
        step = core.step()
        stats = step.scheduler_stats
        if stats is not None:
            totals["num_preemptions"] += stats.num_preemptions
            totals["prefix_cache_hits"] += stats.prefix_cache_hits
            totals["max_running"] = max(totals["max_running"], stats.num_running_reqs)
            if stats.spec_decoding is not None:
                totals["num_draft_tokens"] += stats.spec_decoding.num_draft_tokens
                totals["num_accepted_tokens"] += stats.spec_decoding.num_accepted_tokens
        for out in step.outputs:
            record = outputs[int(out.request_id.removeprefix(prefix))]
            record["tokens"] += out.new_token_ids
            if out.new_logprobs is not None:
                record["logprobs"].append(out.new_logprobs)
            if out.new_prompt_logprobs is not None:
                record["prompt_logprobs"].append(out.new_prompt_logprobs)
    return outputs, totals


def greedy(_i: int, output_len: int = OUTPUT_LEN) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def assert_matches_hf(
    model: str | ModelKey, outputs: dict, prompt_seed: int = 0, output_len: int = OUTPUT_LEN
) -> None:
    expected = hf_greedy(model, prompt_seed, output_len)
    for i, want in enumerate(expected):
        assert len(set(want)) >= MIN_DISTINCT_TOKENS, f"{model} prompt {i}: trivial reference"
        got = tuple(outputs[i]["tokens"])
        assert got == want, f"{model} prompt {i}: first difference at {_first_diff(got, want)}"


def _first_diff(a, b) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_ample_kv_memory(arch):
    outputs, totals = run(make_engine(arch), parity_prompts(), greedy)
    assert totals["num_preemptions"] == 0
    assert totals["max_running"] == NUM_PROMPTS
    assert_matches_hf(arch, outputs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_under_preemption(arch):
    # 40 blocks of 16 hold 640 tokens; the 16 requests need about 2,100 at their longest.
    outputs, totals = run(make_engine(arch, num_blocks=40), parity_prompts(), greedy)
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_chunked_prefill(arch):
    budget = 24
    assert max(len(p) for p in parity_prompts()) > 4 * budget
    outputs, _ = run(make_engine(arch, max_num_batched_tokens=budget), parity_prompts(), greedy)
    assert_matches_hf(arch, outputs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_prefix_caching(arch):
    core = make_engine(arch, prefix_caching=True)
    first, totals_first = run(core, parity_prompts(), greedy, prefix="first-")
    second, totals_second = run(core, parity_prompts(), greedy, prefix="second-")
    # Within the first run prompts share prefixes; the second run finds whole prompts cached.
    assert totals_first["prefix_cache_hits"] > 0
    assert totals_second["prefix_cache_hits"] > totals_first["prefix_cache_hits"]
    assert_matches_hf(arch, first)
    assert_matches_hf(arch, second)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_when_a_prompt_starts_with_a_finished_requests_partial_block(arch):
    """A finished request's last, partly filled block, or the start of a cached whole block, is
    copied into a later request that starts the same way: a prompt asked again gets all but its
    last token from the cache (also after a long answer filled the block), the next turn of a
    conversation (prompt, answer, new text) everything up to the answer's last token, and all
    match transformers."""
    core = make_engine(arch, prefix_caching=True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (21, 37, 70, 110)]
    extra = torch.randint(3, 2000, (5,), generator=gen).tolist()

    def generate(prompts: list[list[int]], tag: str, max_tokens: int):
        """(greedy tokens, checked against transformers; cached prompt tokens) per prompt."""
        for i, prompt in enumerate(prompts):
            params = greedy(i, max_tokens)
            core.add_request(EngineCoreRequest(f"{tag}{i}", prompt, params, eos_token_id=2))
        tokens, cached = {i: [] for i in range(len(prompts))}, {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                i = int(out.request_id.removeprefix(tag))
                tokens[i] += out.new_token_ids
                cached[i] = out.num_cached_tokens
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                want = hf_model(arch).generate(
                    torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False
                )
            assert tokens[i] == want[0, len(prompt) :].tolist(), f"{tag}{i}"
        return [tokens[i] for i in range(len(prompts))], [cached[i] for i in range(len(prompts))]

    # Answered with one token, each prompt's KV ends in its last, partly filled block.
    assert generate(prompts, "first-", 1)[1] == [0, 0, 0, 0]
    answers, cached = generate(prompts, "again-", 16)
    assert cached == [len(p) - 1 for p in prompts]
    # Asked once more: the block holding each prompt's end was filled by the answer and cached
    # whole; its first tokens still serve the prompt.
    assert generate(prompts, "later-", 16) == (answers, [len(p) - 1 for p in prompts])
    turns = [p + answer + extra for p, answer in zip(prompts, answers)]
    # The answers' last tokens have no KV yet (nothing ran after them).
    assert generate(turns, "turn-", 16)[1] == [len(p) + 15 for p in prompts]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_with_async_scheduling(arch):
    """Step n+1 scheduled while step n runs: unchanged tokens with ample memory, under
    preemption (each preemption here meets a step of its victim in flight), with chunked
    prefill, and over a warm prefix cache."""
    outputs, _ = run(make_engine(arch, async_scheduling=True), parity_prompts(), greedy)
    assert_matches_hf(arch, outputs)
    core = make_engine(arch, num_blocks=40, async_scheduling=True)
    outputs, totals = run(core, parity_prompts(), greedy)
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)
    core = make_engine(arch, max_num_batched_tokens=24, prefix_caching=True, async_scheduling=True)
    for prefix in ("first-", "second-"):
        outputs, totals = run(core, parity_prompts(), greedy, prefix=prefix)
        assert_matches_hf(arch, outputs)
    assert totals["prefix_cache_hits"] > 0


def test_greedy_parity_with_a_sliding_window_shorter_than_the_prompts():
    window = 24  # 1.5 KV blocks; shorter than most prompts, and than every prompt + output
    windowed = ("mistral", (("sliding_window", window),))
    prompts = parity_prompts()
    assert sum(len(p) > window for p in prompts) >= NUM_PROMPTS // 2
    # Same weights (the window is no parameter), and transformers' own continuations change with
    # the window: its attention applies it, so matching them shows that the engine's does too.
    assert all(
        torch.equal(a, b)
        for a, b in zip(hf_model(windowed).parameters(), hf_model("mistral").parameters())
    )
    assert hf_model(windowed).config.sliding_window == window
    changed = [a != b for a, b in zip(hf_greedy(windowed), hf_greedy("mistral"))]
    assert sum(changed) >= NUM_PROMPTS // 2
    for budget in (512, 20):  # whole prompts, and chunks that end inside and past the window
        outputs, _ = run(make_engine(windowed, max_num_batched_tokens=budget), prompts, greedy)
        assert_matches_hf(windowed, outputs)


# Wider, deeper models and other prompts; run by the slow nox session.
SWEEP_MODELS = [
    (arch, (("hidden_size", 128), ("intermediate_size", 256), ("num_hidden_layers", 4)))
    for arch in ARCHITECTURES
]


@pytest.mark.slow
@pytest.mark.parametrize("model", SWEEP_MODELS, ids=ARCHITECTURES)
@pytest.mark.parametrize("prompt_seed", [1, 2])
def test_greedy_parity_sweep(model, prompt_seed):
    prompts = parity_prompts(prompt_seed)
    long = functools.partial(greedy, output_len=128)
    settings = [
        dict(),
        dict(num_blocks=48),
        dict(max_num_batched_tokens=16),
        dict(num_blocks=64, max_num_batched_tokens=40, prefix_caching=True),
    ]
    for setting in settings:
        outputs, _ = run(make_engine(model, **setting), prompts, long)
        assert_matches_hf(model, outputs, prompt_seed, output_len=128)
