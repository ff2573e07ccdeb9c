"""Data-parallel attention with expert parallelism against transformers, over the serving path:
``AsyncLLM`` with two engine core processes (``data_parallel_size=2``, one worker rank each, or
two with ``tensor_parallel_size=2``) whose ranks form one expert-parallel group and step in
lock-step (``ember_server.engine.lockstep``).

Greedy tokens equal transformers' in float32, with requests on both engines at once and with a
single request, where the other engine has nothing the whole time and runs only the experts'
collectives (``idle_expert_pass``) so that the busy one's all-to-alls complete; and with a KV pool
small enough to preempt (asserted), prompts chunked by a small token budget and prefix-cache hits
(asserted), where steps that schedule nothing on one engine interleave with the other's; sample
and prompt logprobs within 1e-4 of transformers' log-softmax. Idle
afterwards, the engine cores and their workers take next to no CPU (no one spins).
"""

from __future__ import annotations

import asyncio
import os
import pathlib

import pytest
from test_parity import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    bytes_per_block,
    hf_greedy,
    model_path,
    parity_prompts,
)
from test_parity_sampling import NUM_LOGPROBS, _hf_log_softmax

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.engine_args import EngineArgs

pytestmark = pytest.mark.slow

OUTPUT_LEN = 24
TIMEOUT_S = 600
IDLE_S = 2.0
IDLE_CPU_S = 0.5  # all engine cores and workers together over IDLE_S (a spinning one takes ~2)


def _args(arch: str, tensor_parallel_size: int = 1, **overrides) -> EngineArgs:
    settings = dict(
        model=str(model_path(arch)),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        block_size=BLOCK_SIZE,
        kv_cache_memory=4 * 1024**2,
        num_threads=1,
        data_parallel_size=2,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=True,
        max_engine_restarts=0,
    )
    return EngineArgs(**{**settings, **overrides})


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _process_tree(pid: int) -> list[int]:
    tree = [pid]
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                tree += _process_tree(int(stat.parent.name))
        except OSError:
            continue
    return tree


async def _generate(engine: AsyncLLM, prompt: list[int], request_id: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    final = None
    async for output in engine.generate(prompt, params, request_id, stream=False):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def _run(args: EngineArgs, waves: list[list[int]]) -> tuple[list, list, dict]:
    """Each wave's prompts (indexes into ``parity_prompts``) at once, wave after wave; the
    (prompt index, tokens) of each, the engines' loads as each wave started, and the preemption and prefix-hit
    counters. Then checks that the idle engines take next to no CPU."""
    prompts = parity_prompts()
    engine = await AsyncLLM.start(args)
    got: list[tuple[int, list[int]]] = []
    loads = []
    try:
        for n, wave in enumerate(waves):
            tasks = {
                i: asyncio.ensure_future(_generate(engine, prompts[i], f"w{n}-p{i}")) for i in wave
            }
            await asyncio.sleep(0)
            loads.append(list(engine.router.loads))
            for i, task in tasks.items():
                got.append((i, await asyncio.wait_for(task, TIMEOUT_S)))
        assert engine.is_healthy()
        labels = {"model_name": args.model_name}
        counters = {
            name: engine.metrics.registry.get_sample_value(f"ember:{name}_total", labels)
            for name in ("num_preemptions", "prefix_cache_hits")
        }
        pids = [pid for client in engine.clients for pid in _process_tree(client.pid)]
        assert len(pids) == 2 * (1 + args.tensor_parallel_size)
        await asyncio.sleep(0.5)  # the last outputs' wake-ups settle
        before = _cpu_seconds(pids)
        await asyncio.sleep(IDLE_S)
        assert _cpu_seconds(pids) - before < IDLE_CPU_S
    finally:
        await engine.shutdown()
    return got, loads, counters


def _check(arch: str, got: list[tuple[int, list[int]]]) -> None:
    want = hf_greedy(arch, output_len=OUTPUT_LEN)
    for i, tokens in got:
        assert tuple(tokens) == want[i], f"{arch} prompt {i}"


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_dp2_ep2_matches_transformers_busy_and_with_one_engine_idle(arch):
    # A single request first (the other engine idles through it), then four at once.
    got, loads, _ = asyncio.run(_run(_args(arch), [[0], [1, 2, 3, 4]]))
    assert sorted(loads[0]) == [0, 1]  # one engine busy, one idle
    assert min(loads[1]) > 0  # both engines busy
    _check(arch, got)


def test_dp2_ep2_matches_transformers_preempted_chunked_and_cached():
    arch = "deepseek_v2"
    # 13 usable blocks an engine, 3 requests of up to 7 blocks each: preemption; a budget of 32
    # tokens a step: every prompt chunked; prompts share prefixes, and the second wave repeats
    # one: prefix hits.
    args = _args(
        arch, kv_cache_memory=14 * bytes_per_block(arch), max_model_len=11 * BLOCK_SIZE,
        max_num_batched_tokens=32,
    )  # fmt: skip
    got, _, counters = asyncio.run(_run(args, [[0, 1, 2, 3, 8, 9], [0]]))
    assert len(got) == 7
    assert counters["num_preemptions"] > 0
    assert counters["prefix_cache_hits"] > 0
    _check(arch, got)


def test_dp2_tp2_ep4_matches_transformers():
    got, loads, _ = asyncio.run(_run(_args("mixtral", tensor_parallel_size=2), [[5, 6]]))
    assert min(loads[0]) > 0
    _check("mixtral", got)


def _check_logprobs(entries, reference, targets) -> None:
    """``entries[k]`` (token id -> ``Logprob``) holds ``targets[k]`` and the top
    ``NUM_LOGPROBS`` of ``reference[k]``, each within 1e-4."""
    assert len(entries) == len(targets)
    for entry, ref, target in zip(entries, reference, targets, strict=True):
        top_values, top_ids = ref.topk(NUM_LOGPROBS)
        want = {target: float(ref[target]), **dict(zip(top_ids.tolist(), top_values.tolist()))}
        assert set(entry) == set(want)
        for token, value in want.items():
            assert abs(entry[token].logprob - value) <= 1e-4, (token, entry[token], value)


def test_dp2_ep2_logprobs_match_transformers():
    arch = "mixtral"
    prompts = [parity_prompts()[i] for i in (15, 3, 11)]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS,
    )  # fmt: skip

    async def run():
        engine = await AsyncLLM.start(_args(arch, max_num_batched_tokens=32))
        try:

            async def one(i, prompt):
                final = None
                async for output in engine.generate(prompt, params, f"lp{i}", stream=False):
                    final = output
                return final

            tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
            await asyncio.sleep(0)
            assert min(engine.router.loads) > 0  # on both engines
            return [await asyncio.wait_for(task, TIMEOUT_S) for task in tasks]
        finally:
            await engine.shutdown()

    for prompt, final in zip(prompts, asyncio.run(run()), strict=True):
        tokens = list(final.outputs[0].token_ids)
        reference = _hf_log_softmax(arch, prompt + tokens)
        assert final.prompt_logprobs[0] is None
        _check_logprobs(final.prompt_logprobs[1:], reference[: len(prompt) - 1], prompt[1:])
        _check_logprobs(final.outputs[0].logprobs, reference[len(prompt) - 1 : -1], tokens)
