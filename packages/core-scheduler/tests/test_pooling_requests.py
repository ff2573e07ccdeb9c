"""Pooling requests in the scheduler: prefilled in chunks like any prompt, finished with the
pooled vector right after it (no tokens), prefix-cached only where the pool reads the last
position, and refused with a clear error when their parameters are wrong."""

from __future__ import annotations

import msgspec
import pytest

from ember_kv_cache import KVCacheManager
from ember_scheduler import (
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    PoolingParams,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

BLOCK_SIZE = 4


def _scheduler(budget: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(config, KVCacheManager(32, BLOCK_SIZE))


def _pooling_request(req_id: str, prompt: list[int], **params) -> Request:
    return Request(
        req_id, prompt, SamplingParams(max_tokens=1), pooling_params=PoolingParams(**params)
    )


def _step(scheduler: Scheduler, pooled: dict[str, bytes] | None = None):
    """One step in which every request that completes its prompt is pooled (or samples 7)."""
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled, pooler_output = [], {}
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        complete = request.num_computed_tokens >= request.num_tokens
        if request.pooling_params is not None:
            sampled.append([])
            if complete:
                pooler_output[req_id] = (pooled or {}).get(req_id, b"\0" * 8)
        else:
            sampled.append([7] if complete else [])
    runner_output = ModelRunnerOutput(
        req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, pooler_output=pooler_output
    )
    return out, scheduler.update_from_output(out, runner_output)


def test_a_pooling_request_is_chunked_and_finishes_after_its_prompt():
    scheduler = _scheduler(budget=8)
    scheduler.add_request(_pooling_request("pool", list(range(1, 21))))
    scheduler.add_request(Request("gen", [1, 2, 3], SamplingParams(max_tokens=3)))
    outputs, chunks = [], []
    while scheduler.has_requests():
        out, result = _step(scheduler, {"pool": b"\x01\x02\x03\x04"})
        chunks.append(out.num_scheduled_tokens.get("pool", 0))
        assert out.total_num_scheduled_tokens <= 8
        outputs += result.outputs
    assert chunks[:3] == [8, 8, 4]  # 20 prompt tokens under a budget of 8
    pool = [o for o in outputs if o.request_id == "pool"]
    assert len(pool) == 1 and pool[0].new_token_ids == []
    assert pool[0].finish_reason == FinishReason.STOP
    assert pool[0].pooling_output == b"\x01\x02\x03\x04"
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "gen") == 3
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.requests


@pytest.mark.parametrize(("pooling_type", "cached"), [("last", 16), ("mean", 0), ("cls", 0)])
def test_prefix_cache_only_where_pooling_reads_the_last_position(pooling_type, cached):
    scheduler = _scheduler(budget=32)
    prompt = list(range(1, 19))  # 4 whole blocks and 2 tokens
    for req_id in ("first", "second"):
        scheduler.add_request(_pooling_request(req_id, prompt, pooling_type=pooling_type))
        while scheduler.has_requests():
            _, result = _step(scheduler)
    assert result.outputs[0].num_cached_tokens == cached
    assert result.outputs[0].pooling_output is not None


def test_pooling_params_are_checked_and_cross_the_wire():
    with pytest.raises(ValueError, match=r"PoolingParams\.pooling_type"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match=r"PoolingParams\.task"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match=r"PoolingParams\.dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="must be 'last' for task 'classify'"):
        PoolingParams(task="classify", pooling_type="mean")
    request = EngineCoreRequest(
        "r", [1, 2], SamplingParams(), pooling_params=PoolingParams(dimensions=8)
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.pooling_params == PoolingParams(dimensions=8)
    bad = msgspec.msgpack.encode(["embed", "max"])
    with pytest.raises(msgspec.ValidationError, match="pooling_type"):
        msgspec.msgpack.decode(bad, type=PoolingParams)
