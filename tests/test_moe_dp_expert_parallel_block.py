"""The MoE layers of a real checkpoint over two data-parallel replicas in one expert-parallel
group (``ParallelConfig.data_parallel_size`` 2, one rank each, gloo): each replica runs tokens of
its own through every MoE layer and gets the one-rank layers' outputs; a replica with no tokens
runs ``idle_expert_pass`` instead, and the other replica's outputs are still exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember_testing.tiny_models import tiny_model_path
from ember_worker.distributed.groups import ParallelConfig, init_rank_groups
from ember_worker.distributed.ports import free_port
from ember_worker.model_loader import load_model
from ember_worker.models.moe import SparseMoeBlock, idle_expert_pass

REPLICAS = 2
# Tokens per replica per step: both busy (a prefill beside a decode), then replica 1 idle.
TOKEN_COUNTS = ((9, 1), (4, 0))


def _inputs(hidden: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [[torch.randn(n, hidden, generator=gen) for n in step] for step in TOKEN_COUNTS]


def _blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _replica_main(replica: int, port: int, arch: str, queue) -> None:
    torch.set_num_threads(1)
    config = ParallelConfig(
        enable_expert_parallel=True,
        data_parallel_size=REPLICAS,
        data_parallel_rank=replica,
        data_parallel_init_method=f"tcp://127.0.0.1:{port}",
    )
    groups = init_rank_groups(config, 0, "unused", "gloo")
    try:
        assert groups.tp.size == 1 and groups.ep.size == REPLICAS
        loaded = load_model(
            tiny_model_path(arch), dtype="float32", tp=groups.tp, expert_parallel=True,
            ep=groups.ep,
        )  # fmt: skip
        blocks = _blocks(loaded.model)
        outs = []
        with torch.inference_mode():
            for step in _inputs(loaded.config.hidden_size):
                x = step[replica]
                if x.shape[0]:
                    outs.append([block(x).numpy() for block in blocks])
                else:
                    idle_expert_pass(loaded.model)
                    outs.append(None)
        queue.put((replica, outs))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks loading the model: tens of seconds
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_replicas_share_the_experts_and_an_idle_replica_serves_them(arch):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_replica_main, args=(r, port, arch, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    whole = load_model(tiny_model_path(arch), dtype="float32")
    blocks = _blocks(whole.model)
    assert blocks
    with torch.inference_mode():
        for index, step in enumerate(_inputs(whole.config.hidden_size)):
            for replica, x in enumerate(step):
                if not x.shape[0]:
                    assert got[replica][index] is None
                    continue
                for block, out in zip(blocks, got[replica][index], strict=True):
                    torch.testing.assert_close(torch.from_numpy(out), block(x), rtol=1e-5,
                                               atol=1e-6)  # fmt: skip


def test_data_parallel_needs_expert_parallel_and_an_address():
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        ParallelConfig(data_parallel_size=2, data_parallel_init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="data_parallel_init_method"):
        ParallelConfig(enable_expert_parallel=True, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        ParallelConfig(
            enable_expert_parallel=True, data_parallel_size=2, data_parallel_rank=2,
            data_parallel_init_method="tcp://127.0.0.1:1",
        )  # fmt: skip
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelConfig(
            pipeline_parallel_size=2, enable_expert_parallel=True, data_parallel_size=2,
            data_parallel_init_method="tcp://127.0.0.1:1",
        )  # fmt: skip
