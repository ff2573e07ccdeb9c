"""LoRA adapters in the scheduler: the per-step adapter limit, requests waiting for a seat
without blocking others, and prefix-cache hits never shared across adapters."""

import msgspec
import pytest
from fake_executor import FakeExecutor, make_request, run_to_completion

from ember_scheduler import EngineCore, SamplingParams, SchedulerConfig
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.lora import LoRAConfig, LoRARequest
from ember_scheduler.outputs import SchedulerOutput


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}")


def _engine(max_loras=2, **config):
    config.setdefault("max_model_len", 256)
    executor = FakeExecutor(64, 4)
    lora_config = LoRAConfig(max_loras=max_loras, max_cpu_loras=4)
    return EngineCore(executor, SchedulerConfig(lora=lora_config, **config)), executor


def test_at_most_max_loras_adapters_run_and_a_waiting_adapter_does_not_block_others():
    engine, _ = _engine(max_loras=2)
    params = SamplingParams(max_tokens=6)
    # Adapters 1 and 2 take both seats; the adapter-3 request waits, but the requests behind it
    # (adapter 1 and the base model) are admitted in the same step.
    for rid, adapter in [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", None)]:
        request = lora(adapter) if adapter else None
        engine.add_request(make_request(rid, [5, 6, 7, 8, 9], params, lora_request=request))
    first = engine.scheduler.schedule()
    admitted = [new.req_id for new in first.scheduled_new_reqs]
    assert admitted == ["a", "b", "d", "e"]
    assert {new.lora_request for new in first.scheduled_new_reqs} == {lora(1), lora(2), None}
    assert [r.request_id for r in engine.scheduler.waiting] == ["c"]
    stats = engine.scheduler.make_stats().lora
    assert (stats.max_loras, stats.running, stats.waiting) == (
        2,
        ["adapter1", "adapter2"],
        ["adapter3"],
    )


def test_every_step_holds_at_most_max_loras_adapters_and_all_finish():
    engine, _ = _engine(max_loras=2, max_num_seqs=8)
    for i in range(12):
        adapter = lora(1 + i % 4) if i % 3 else None
        engine.add_request(
            make_request(f"r{i}", [3 + i, 4, 5], SamplingParams(max_tokens=5), lora_request=adapter)
        )
    scheduler = engine.scheduler
    seen = []
    original = scheduler.schedule

    def schedule() -> SchedulerOutput:
        out = original()
        seen.append({r.lora_request for r in scheduler.running if r.lora_request})
        return out

    scheduler.schedule = schedule
    results, _ = run_to_completion(engine)
    assert len(results) == 12
    assert max(len(s) for s in seen) == 2


def test_a_prefix_shared_by_two_adapters_is_not_reused_across_them():
    engine, _ = _engine(max_loras=2)
    prompt = list(range(10, 30))  # five full blocks of 4
    params = SamplingParams(max_tokens=2)
    engine.add_request(make_request("first", prompt, params, lora_request=lora(1)))
    run_to_completion(engine)
    engine.add_request(make_request("other-adapter", prompt, params, lora_request=lora(2)))
    engine.add_request(make_request("base", prompt, params))
    results, _ = run_to_completion(engine)
    assert results["other-adapter"].num_cached_tokens == 0
    assert results["base"].num_cached_tokens == 0
    engine.add_request(make_request("same-adapter", prompt, params, lora_request=lora(1)))
    results, _ = run_to_completion(engine)
    # Everything but the last prompt token, whose logits must be computed.
    assert results["same-adapter"].num_cached_tokens == len(prompt) - 1


def test_a_lora_request_without_enable_lora_is_refused():
    engine = EngineCore(FakeExecutor(64, 4), SchedulerConfig(max_model_len=256))
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request(make_request("a", [1, 2], lora_request=lora(1)))


def test_lora_request_and_config_validate_and_cross_the_wire():
    request = EngineCoreRequest("r", [1], SamplingParams(), lora_request=lora(3))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert back.lora_request == lora(3) and back.lora_name == "adapter3"
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
