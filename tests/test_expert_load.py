"""Per-expert load statistics (``ember_worker.expert_load``): the counts a model run leaves equal
the slots its routers chose, layer by layer, and the periodic log line reports them."""

from __future__ import annotations

import logging

import pytest
import torch
from test_parity import BLOCK_SIZE, MAX_MODEL_LEN, greedy, parity_prompts, run

from ember_kernels import moe as moe_ops
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_testing.tiny_models import tiny_model_path
from ember_worker.executor import InProcessExecutor
from ember_worker.expert_load import describe_load
from ember_worker.models.moe import SparseMoeBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(arch: str, interval: int) -> tuple[EngineCore, InProcessExecutor]:
    executor = InProcessExecutor(
        tiny_model_path(arch),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
        kv_cache_memory=8 * 1024**2,
        expert_load_log_interval=interval,
    )
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
    return EngineCore(executor, config, executor.grammar_compiler), executor


def _routing_counts(block: SparseMoeBlock, logits: torch.Tensor) -> torch.Tensor:
    moe = block.moe
    _, ids = moe_ops.select_experts(
        logits,
        moe.top_k,
        scoring=moe.scoring,
        renormalize=moe.renormalize,
        num_expert_group=moe.num_expert_group,
        topk_group=moe.topk_group,
        correction_bias=block.gate.e_score_correction_bias,
        routed_scaling_factor=moe.routed_scaling_factor,
    )
    return torch.bincount(ids.reshape(-1), minlength=moe.num_experts)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_counts_equal_the_routers_choices(arch):
    core, executor = _engine(arch, interval=0)
    stats = executor.worker.expert_load
    blocks = [block for _, block in stats.blocks]
    expected = [torch.zeros(b.moe.num_experts, dtype=torch.long) for b in blocks]
    tokens = [0]

    def record(i):
        def hook(module, args, logits):
            expected[i] += _routing_counts(blocks[i], logits)
            if i == 0:
                tokens[0] += logits.shape[0]

        return hook

    stats.take()  # whatever a warm-up left
    handles = [b.gate.register_forward_hook(record(i)) for i, b in enumerate(blocks)]
    try:
        run(core, parity_prompts()[:4], greedy)
    finally:
        for handle in handles:
            handle.remove()
    counts = stats.take()
    # qwen2_moe: layers 0 and 2 (1 is dense); DeepSeek: 1 and 2 (0 is dense)
    assert stats.layers == ([0, 2] if arch == "qwen2_moe" else [1, 2])
    assert counts.shape == (len(blocks), blocks[0].moe.num_experts)
    assert torch.equal(counts, torch.stack(expected))
    assert (counts.sum(dim=1) == tokens[0] * blocks[0].moe.top_k).all()
    assert int(stats.take().sum()) == 0  # taking restarts the counters


def test_the_load_is_logged_every_interval(caplog):
    core, _ = _engine("mixtral", interval=2)
    with caplog.at_level(logging.INFO, logger="ember_worker.expert_load"):
        run(core, parity_prompts()[:2], greedy)
    lines = [r.getMessage() for r in caplog.records if r.name == "ember_worker.expert_load"]
    assert lines and all(line.startswith("expert load over 2 steps:") for line in lines)
    assert "balancedness" in lines[0]


def test_describe_load_names_the_balance_and_the_hottest_expert():
    counts = torch.tensor([[4, 4, 4, 4], [10, 2, 2, 2]])
    line = describe_load(counts, [0, 3], 5)
    assert "16 routed slots per MoE layer" in line
    assert "1.000 on average" not in line and "0.400 at worst (layer 3)" in line
    assert "hottest expert 0 of layer 3 with 62.5%" in line
    assert "no tokens routed" in describe_load(torch.zeros(2, 4, dtype=torch.long), [0, 1], 5)


def test_interval_must_be_a_non_negative_int():
    from ember_worker.distributed.worker import WorkerConfig

    with pytest.raises(ValueError, match="expert_load_log_interval"):
        WorkerConfig("m", expert_load_log_interval=-1)
