"""Worker ranks in their own processes: groups, start-up failures and dead ranks.

Token-level parity of tensor and pipeline parallelism with transformers lives in the root
``tests/test_parity_distributed.py``.
"""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch
from small_worker import SMALL_SETTINGS
from transformers import AutoModelForCausalLM

from ember_worker.distributed.groups import ParallelConfig, PipelineStage
from ember_worker.distributed.mp_executor import MultiprocExecutor
from ember_worker.distributed.worker import WorkerConfig, WorkerFailedError
from ember_worker.executor_factory import make_executor


def _config(path, **kwargs) -> WorkerConfig:
    settings = dict(SMALL_SETTINGS, parallel=ParallelConfig(tensor_parallel_size=2))
    return WorkerConfig(str(path), **{**settings, **kwargs})


def _running(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_parallel_config_names_the_output_rank_and_world():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert config.world_size == 6
    assert config.output_rank == 4  # the last stage's first tensor-parallel rank
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive int"):
        ParallelConfig(pipeline_parallel_size=0)


@pytest.mark.parametrize(("size", "layers", "ranges"), [(2, 5, [(0, 2), (2, 5)]), (3, 3, None)])
def test_pipeline_stages_split_layers_evenly(size, layers, ranges):
    got = [PipelineStage(rank, size).layer_range(layers) for rank in range(size)]
    assert got == (ranges or [(0, 1), (1, 2), (2, 3)])
    with pytest.raises(ValueError, match="exceeds the model's num_hidden_layers"):
        PipelineStage(0, size).layer_range(size - 1)


def test_backend_choice_is_checked(tiny_model):
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        make_executor(_config(path), "uni")
    with pytest.raises(ValueError, match="must be one of"):
        make_executor(_config(path), "threads")


def test_a_rank_that_fails_at_start_up_reports_its_error(tiny_model):
    # 3 query heads cannot be split over 2 ranks: every rank fails while building its shard.
    path = tiny_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    before = set(_children())
    with pytest.raises(WorkerFailedError, match=r"worker rank \d failed at start-up: ValueError: "
                       r"num_attention_heads \(3\) is not divisible by tensor_parallel_size"):  # fmt: skip
        MultiprocExecutor(_config(path))
    assert not [pid for pid in set(_children()) - before if _running(pid)]


def test_replicated_kv_heads_match_transformers_then_a_killed_rank_fails_the_step(tiny_model):
    """One start-up serves two checks: two ranks sharing the model's single KV head decode as
    transformers does; then one rank is killed, the next step fails naming it, and shutdown
    leaves no process."""
    from ember_scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from ember_scheduler.sampling_params import SamplingParams

    path = tiny_model("llama", num_key_value_heads=1)
    prompt, num_new = list(range(10, 18)), 6
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)
    executor = MultiprocExecutor(_config(path))
    pids = executor.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=num_new)
    new = NewRequestData("a", prompt, [], params, [0, 1, 2, 3], 0)
    got = executor.execute_model(SchedulerOutput([new], CachedRequestData(), {"a": 8}, 8))
    tokens = got.sampled_token_ids[0]
    for computed in range(len(prompt), len(prompt) + num_new - 1):
        step = SchedulerOutput([], CachedRequestData(["a"], [[]], [computed]), {"a": 1}, 1)
        tokens += executor.execute_model(step).sampled_token_ids[0]
    assert tokens == want[0, len(prompt) :].tolist()

    os.kill(pids[1], signal.SIGKILL)
    step = SchedulerOutput([], CachedRequestData(["a"], [[]], [13]), {"a": 1}, 1)
    with pytest.raises(WorkerFailedError, match="worker rank 1"):
        executor.execute_model(step)
    executor.shutdown()
    assert not any(map(_running, pids))


def _children() -> list[int]:
    me = os.getpid()
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(stat.parent.name))
        except OSError:
            continue
    return found
