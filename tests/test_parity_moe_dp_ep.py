"""Data-parallel attention with expert parallelism against transformers, over the serving path:
``AsyncLLM`` with two engine core processes (``data_parallel_size=2``, one worker rank each, or
two with ``tensor_parallel_size=2``) whose ranks form one expert-parallel group and step in
lock-step (``ember_server.engine.lockstep``).

Greedy tokens equal transformers' in float32, with requests on both engines at once and with a
single request, where the other engine has nothing the whole time and runs only the experts'
collectives (``idle_expert_pass``) so that the busy one's all-to-alls complete.
"""

from __future__ import annotations

import asyncio

import pytest
from test_parity import BLOCK_SIZE, MAX_MODEL_LEN, hf_greedy, model_path, parity_prompts

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.engine_args import EngineArgs

pytestmark = pytest.mark.slow

OUTPUT_LEN = 24
TIMEOUT_S = 600


def _args(arch: str, tensor_parallel_size: int = 1) -> EngineArgs:
    return EngineArgs(
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


async def _generate(engine: AsyncLLM, prompt: list[int], request_id: str) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    final = None
    async for output in engine.generate(prompt, params, request_id, stream=False):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def _run(args: EngineArgs, waves: list[list[int]]) -> tuple[dict[int, list[int]], list]:
    """Each wave's prompts (indexes into ``parity_prompts``) at once, wave after wave; the
    tokens of each, and the engine each went to."""
    prompts = parity_prompts()
    engine = await AsyncLLM.start(args)
    got: dict[int, list[int]] = {}
    loads = []
    try:
        for wave in waves:
            tasks = {i: asyncio.ensure_future(_generate(engine, prompts[i], f"p{i}")) for i in wave}
            await asyncio.sleep(0)
            loads.append(list(engine.router.loads))
            for i, task in tasks.items():
                got[i] = await asyncio.wait_for(task, TIMEOUT_S)
        assert engine.is_healthy()
    finally:
        await engine.shutdown()
    return got, loads


def _check(arch: str, got: dict[int, list[int]]) -> None:
    want = hf_greedy(arch, output_len=OUTPUT_LEN)
    for i, tokens in got.items():
        assert tuple(tokens) == want[i], f"{arch} prompt {i}"


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_dp2_ep2_matches_transformers_busy_and_with_one_engine_idle(arch):
    # A single request first (the other engine idles through it), then four at once.
    got, loads = asyncio.run(_run(_args(arch), [[0], [1, 2, 3, 4]]))
    assert sorted(loads[0]) == [0, 1]  # one engine busy, one idle
    assert min(loads[1]) > 0  # both engines busy
    _check(arch, got)


def test_dp2_tp2_ep4_matches_transformers():
    got, loads = asyncio.run(_run(_args("mixtral", tensor_parallel_size=2), [[5, 6]]))
    assert min(loads[0]) > 0
    _check("mixtral", got)
