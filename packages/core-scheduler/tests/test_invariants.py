"""Hypothesis interleaves adds, aborts and steps and checks the scheduler's invariants."""

import pytest
from fake_executor import FakeExecutor, collect, make_request, reference_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember_scheduler import EngineCore, SamplingParams, SchedulerConfig

MAX_MODEL_LEN = 40

_config = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4]),
        "pool_tokens": st.sampled_from([24, 40, 80, 400]),
        "max_num_seqs": st.integers(1, 8),
        "budget": st.integers(1, 48),
        "threshold": st.sampled_from([0, 3, 16]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "spec": st.sampled_from([0, 0, 2]),
        "async_scheduling": st.booleans(),
    }
)
_add = st.tuples(
    st.just("add"),
    st.lists(st.integers(1, 96), min_size=1, max_size=50),
    st.integers(1, 20),  # max_tokens
    st.integers(0, 3),  # priority
    st.booleans(),  # ignore_eos
)
_abort = st.tuples(st.just("abort"), st.integers(0, 1000))
_step = st.tuples(st.just("step"), st.integers(1, 4))
_ops = st.lists(st.one_of(_add, _abort, _step), min_size=1, max_size=40)


def _check_invariants(engine, executor, config):
    scheduler = engine.scheduler
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    assert not running & waiting
    assert running | waiting == set(scheduler.requests)
    assert len(running) <= config["max_num_seqs"]
    kv = engine.kv_cache_manager
    for request in scheduler.running:
        # Under async scheduling the tokens of steps in flight count (placeholders).
        assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders
        assert (
            len(kv.get_block_ids(request.request_id)) * kv.block_size >= request.num_computed_tokens
        )
    for request in scheduler.waiting:
        with pytest.raises(ValueError):
            kv.get_block_ids(request.request_id)  # a waiting request holds no blocks
    if executor.scheduler_outputs:
        so = executor.scheduler_outputs[-1]
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= config["budget"]
        if config["threshold"]:
            for new in so.scheduled_new_reqs:
                assert so.num_scheduled_tokens[new.req_id] <= config["threshold"]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=_config, ops=_ops)
def test_interleaved_adds_aborts_and_steps_keep_the_invariants(config, ops):
    size = config["block_size"]
    num_blocks = config["pool_tokens"] // size + 1
    executor = FakeExecutor(num_blocks, size, num_spec_tokens=config["spec"])
    engine = EngineCore(
        executor,
        SchedulerConfig(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["budget"],
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=config["threshold"],
            policy=config["policy"],
            num_lookahead_tokens=config["spec"],
            num_speculative_tokens=config["spec"],
            async_scheduling=config["async_scheduling"],
        ),
    )
    max_len = engine.scheduler.max_num_tokens
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    results: dict = {}

    def step():
        collect(engine.step(), results)
        _check_invariants(engine, executor, config)

    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, priority, ignore_eos = op
            rid = f"r{len(added)}"
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            added[rid] = (prompt, params)
            engine.add_request(make_request(rid, prompt, params, priority=priority))
        elif op[0] == "abort" and added:
            rid = f"r{op[1] % len(added)}"
            was_live = rid in engine.scheduler.requests
            engine.abort_requests([rid])
            assert rid not in engine.scheduler.requests
            with pytest.raises(ValueError):
                engine.kv_cache_manager.get_block_ids(rid)  # no blocks held: freed at once
            if was_live:
                aborted.add(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()

    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests()

    for rid, (prompt, params) in added.items():
        tokens, reason, stop_reason = reference_output(prompt, params, max_len)
        got = results.get(rid)
        if rid in aborted:
            assert got is None or (
                got.finish_reason is None and tokens[: len(got.token_ids)] == got.token_ids
            )
            continue
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (tokens, reason, stop_reason)
    kv = engine.kv_cache_manager
    assert kv.usage == 0.0 and kv.num_free_blocks == num_blocks - 1
