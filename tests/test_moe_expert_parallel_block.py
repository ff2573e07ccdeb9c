"""One MoE layer of a real checkpoint over two gloo ranks with ``expert_parallel``: both ranks
hold the same tokens (as after tensor-parallel attention), each runs its slice through the
all-to-all dispatch and combine, and every rank ends with the one-rank layer's output; the
per-expert load, summed over the ranks, equals the router's choices over all the tokens."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember_kernels import moe as moe_ops
from ember_testing.tiny_models import tiny_model_path
from ember_worker.expert_load import ExpertLoadStats
from ember_worker.layers.parallel import TensorParallelGroup
from ember_worker.model_loader import load_model

RANKS = 2
TOKEN_COUNTS = (9, 1, 0)  # a prefill, a decode (one rank's slice empty), an empty step


def _inputs(arch: str, hidden: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(n, hidden, generator=gen) for n in TOKEN_COUNTS]


def _rank_main(rank: int, port: int, arch: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)  # fmt: skip
    try:
        tp = TensorParallelGroup(rank, RANKS, dist.group.WORLD)
        loaded = load_model(tiny_model_path(arch), dtype="float32", tp=tp, expert_parallel=True)
        stats = ExpertLoadStats(loaded.model, tp)
        stats.take()
        block = stats.blocks[0][1]
        with torch.inference_mode():
            outs = [block(x) for x in _inputs(arch, loaded.config.hidden_size)]
        # numpy arrays travel by value (a shared tensor would die with this process).
        queue.put((rank, [o.numpy() for o in outs], stats.take().numpy()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("arch", ["qwen2_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_expert_parallel_layer_equals_the_one_rank_layer(arch):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, arch, queue)) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = {
        rank: ([torch.from_numpy(o) for o in outs], torch.from_numpy(counts))
        for rank, outs, counts in (queue.get(timeout=300) for _ in procs)
    }
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    whole = load_model(tiny_model_path(arch), dtype="float32")
    stats = ExpertLoadStats(whole.model, TensorParallelGroup())
    block = stats.blocks[0][1]
    moe = block.moe
    expected_counts = torch.zeros(len(stats.blocks), moe.num_experts, dtype=torch.long)
    with torch.inference_mode():
        for step, x in enumerate(_inputs(arch, whole.config.hidden_size)):
            want = block(x)
            for rank in range(RANKS):  # every rank holds the whole layer output
                torch.testing.assert_close(got[rank][0][step], want, rtol=1e-5, atol=1e-6)
            _, ids = moe_ops.select_experts(
                block.gate(x), moe.top_k, scoring=moe.scoring, renormalize=moe.renormalize,
                num_expert_group=moe.num_expert_group, topk_group=moe.topk_group,
                correction_bias=block.gate.e_score_correction_bias,
                routed_scaling_factor=moe.routed_scaling_factor,
            )  # fmt: skip
            expected_counts[0] += torch.bincount(ids.reshape(-1), minlength=moe.num_experts)
    for rank in range(RANKS):  # summed over the expert-parallel group, the same on every rank
        assert torch.equal(got[rank][1], expected_counts)
