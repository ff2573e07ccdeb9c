"""Scheduler behaviour, driven through EngineCore with the deterministic fake executor."""

import pytest
from fake_executor import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    assert_all_free,
    collect,
    engine_with_fake_executor,
    make_request,
    random_prompts,
    reference_output,
    run_to_completion,
)

from ember_scheduler import (
    EngineCoreRequest,
    SamplingParams,
)


def test_outputs_match_the_reference_and_blocks_are_freed():
    engine, _ = engine_with_fake_executor()
    prompts = random_prompts(12)
    params = SamplingParams(max_tokens=24)
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params))
    results, _ = run_to_completion(engine)
    for rid, prompt in prompts.items():
        tokens, reason, stop_reason = reference_output(prompt, params, 256)
        assert results[rid].token_ids == tokens
        assert results[rid].finish_reason == reason
        assert results[rid].stop_reason == stop_reason
    assert_all_free(engine)


def test_chunked_prefill_never_exceeds_the_budget_or_the_threshold():
    engine, executor = engine_with_fake_executor(
        num_blocks=128, max_num_batched_tokens=24, long_prefill_token_threshold=10
    )
    prompts = random_prompts(8, seed=1, max_len=90)
    params = SamplingParams(max_tokens=6)
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params))
    results, _ = run_to_completion(engine)
    chunked = False
    for so in executor.scheduler_outputs:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= 24
        assert all(0 < n <= 10 for n in so.num_scheduled_tokens.values())
        chunked |= any(
            len(prompts[new.req_id]) - new.num_computed_tokens > 10 for new in so.scheduled_new_reqs
        )
    assert chunked  # some prompt really was split
    for rid, prompt in prompts.items():
        assert results[rid].token_ids == reference_output(prompt, params, 256)[0]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    engine, executor = engine_with_fake_executor(
        num_blocks=128, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    prompts = {"a": list(range(1, 41)), "b": list(range(41, 81))}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, SamplingParams(max_tokens=3)))
    results, _ = run_to_completion(engine)
    first = executor.scheduler_outputs[0]
    assert first.num_scheduled_tokens == {"a": 40}  # b does not fit whole: it is not chunked
    for so in executor.scheduler_outputs:
        for new in so.scheduled_new_reqs:
            assert so.num_scheduled_tokens[new.req_id] == 40 - new.num_computed_tokens
    assert (
        results["b"].token_ids
        == reference_output(prompts["b"], SamplingParams(max_tokens=3), 64)[0]
    )


def test_prefix_cache_hits_are_reported_and_do_not_change_outputs():
    engine, executor = engine_with_fake_executor(num_blocks=64, block_size=4)
    prompt = list(range(1, 30))
    params = SamplingParams(max_tokens=5)
    engine.add_request(make_request("first", prompt, params))
    results, _ = run_to_completion(engine)
    engine.add_request(make_request("second", prompt, params))
    engine.add_request(make_request("other", [5, *prompt[1:]], params))
    more, stats = run_to_completion(engine)
    assert more["second"].num_cached_tokens == 28  # 7 whole blocks; the last token is computed
    assert more["other"].num_cached_tokens == 0  # the first block differs, so nothing is shared
    assert more["second"].token_ids == results["first"].token_ids
    assert stats[0].prefix_cache_hits == 28 and stats[0].prefix_cache_queries == 58
    assert executor.scheduler_outputs[-1].scheduled_new_reqs == []


def test_cache_salt_separates_prefix_caches():
    engine, _ = engine_with_fake_executor()
    prompt = list(range(1, 30))
    wire = EngineCoreRequest("a", prompt, SamplingParams(max_tokens=2), EOS_TOKEN_ID)
    engine.add_request(wire)
    run_to_completion(engine)
    for rid, salt in (("salted", "s"), ("plain", None)):
        engine.add_request(
            EngineCoreRequest(
                rid, prompt, SamplingParams(max_tokens=2), EOS_TOKEN_ID, cache_salt=salt
            )
        )
    results, _ = run_to_completion(engine)
    assert results["salted"].num_cached_tokens == 0
    assert results["plain"].num_cached_tokens == 28


def test_common_prefix_blocks_count_the_blocks_every_running_request_shares():
    engine, executor = engine_with_fake_executor(num_blocks=64, block_size=4)
    shared = list(range(1, 13))  # 3 whole blocks
    engine.add_request(make_request("warm", [*shared, 50], SamplingParams(max_tokens=1)))
    run_to_completion(engine)
    for i in range(3):
        engine.add_request(
            make_request(f"r{i}", [*shared, 60 + i, 70], SamplingParams(max_tokens=4))
        )
    engine.step()
    assert executor.scheduler_outputs[-1].num_common_prefix_blocks == 3


def test_fcfs_preemption_evicts_the_newest_and_outputs_survive():
    engine, executor = engine_with_fake_executor(
        num_blocks=9, block_size=4, max_num_seqs=4
    )  # 8 usable blocks
    prompts = {"old": list(range(1, 12)), "new": list(range(20, 31))}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params, arrival_time=float(rid == "new")))
    results, stats = run_to_completion(engine)
    preempted = [so.preempted_req_ids for so in executor.scheduler_outputs if so.preempted_req_ids]
    assert preempted and all(ids == {"new"} for ids in preempted)
    assert sum(s.num_preemptions for s in stats) == len(preempted)
    resumed = [
        new
        for so in executor.scheduler_outputs
        for new in so.scheduled_new_reqs
        if new.output_token_ids
    ]
    assert resumed and resumed[0].req_id == "new"  # sent again in full, with its outputs so far
    for rid, prompt in prompts.items():
        assert results[rid].token_ids == reference_output(prompt, params, 256)[0]
    assert_all_free(engine)


def test_priority_order_is_honoured():
    engine, executor = engine_with_fake_executor(max_num_seqs=1, policy="priority")
    order = [("low", 5, 0.0), ("high", 0, 2.0), ("mid", 1, 1.0), ("high_late", 0, 3.0)]
    for rid, priority, arrival in order:
        engine.add_request(
            make_request(
                rid,
                [1, 2, 3],
                SamplingParams(max_tokens=2),
                priority=priority,
                arrival_time=arrival,
            )
        )
    run_to_completion(engine)
    admitted = [new.req_id for so in executor.scheduler_outputs for new in so.scheduled_new_reqs]
    assert admitted == ["high", "high_late", "mid", "low"]


def test_priority_preemption_evicts_the_lowest_priority_even_if_scheduled_first():
    engine, executor = engine_with_fake_executor(
        num_blocks=7, block_size=4, policy="priority"
    )  # 6 usable blocks
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # "low" arrives first and is scheduled first each step; "high" needs its blocks.
    engine.add_request(
        make_request("low", list(range(1, 12)), params, priority=9, arrival_time=0.0)
    )
    engine.add_request(
        make_request("high", list(range(30, 41)), params, priority=0, arrival_time=1.0)
    )
    results, _ = run_to_completion(engine)
    preempted = set().union(*(so.preempted_req_ids for so in executor.scheduler_outputs))
    assert preempted == {"low"}
    for so in executor.scheduler_outputs:
        if so.preempted_req_ids:
            assert "low" not in so.num_scheduled_tokens  # its work this step was withdrawn
            assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    finish_order = [so for so in executor.scheduler_outputs if "high" in so.finished_req_ids]
    assert finish_order and "low" not in finish_order[0].finished_req_ids
    for rid, prompt in (("low", list(range(1, 12))), ("high", list(range(30, 41)))):
        assert results[rid].token_ids == reference_output(prompt, params, 256)[0]
    assert_all_free(engine)


def test_abort_frees_blocks_at_once_and_tells_the_worker():
    engine, executor = engine_with_fake_executor()
    for rid in ("a", "b", "c"):
        engine.add_request(
            make_request(rid, list(range(1, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
        )
    engine.step()
    usage = engine.kv_cache_manager.usage
    engine.abort_requests(["a", "unknown"])
    assert engine.kv_cache_manager.usage < usage
    engine.abort_requests("c")
    assert engine.scheduler.get_num_unfinished_requests() == 1
    outputs = engine.step()
    assert executor.scheduler_outputs[-1].finished_req_ids == {"a", "c"}
    assert [o.request_id for o in outputs.outputs] == ["b"]
    engine.abort_requests(["b"])
    assert_all_free(engine)


def test_abort_of_a_waiting_request():
    engine, executor = engine_with_fake_executor(max_num_seqs=1)
    engine.add_request(make_request("a", [1, 2], SamplingParams(max_tokens=3)))
    engine.add_request(make_request("b", [1, 2], SamplingParams(max_tokens=3)))
    engine.abort_requests(["b"])
    results, _ = run_to_completion(engine)
    assert set(results) == {"a"}
    assert all("b" not in so.num_scheduled_tokens for so in executor.scheduler_outputs)


@pytest.mark.parametrize(
    ("prompt_len", "blocks", "words"),
    [(300, 512, "max_model_len (256)"), (60, 9, "KV cache capacity")],
)
def test_a_prompt_that_can_never_fit_is_ignored_and_others_are_unaffected(
    prompt_len, blocks, words
):
    engine, _ = engine_with_fake_executor(num_blocks=blocks, block_size=4, max_num_seqs=2)
    assert engine.max_num_tokens == min(256, (blocks - 1) * 4) < prompt_len  # block 0 is null
    params = SamplingParams(max_tokens=4)
    engine.add_request(make_request("ok1", [1, 2, 3], params))
    engine.add_request(make_request("huge", [7] * prompt_len, params))
    engine.add_request(make_request("ok2", [4, 5], params))
    results, _ = run_to_completion(engine)
    assert results["huge"].finish_reason == "ignored" and results["huge"].token_ids == []
    assert words in results["huge"].finish_detail
    for rid, prompt in (("ok1", [1, 2, 3]), ("ok2", [4, 5])):
        assert results[rid].token_ids == reference_output(prompt, params, 256)[0]
    assert_all_free(engine)


def test_duplicate_request_ids_are_rejected_without_harm():
    engine, _ = engine_with_fake_executor()
    engine.add_request(make_request("a", [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(make_request("a", [3, 4], SamplingParams(max_tokens=2)))
    results, _ = run_to_completion(engine)
    assert results["a"].token_ids == reference_output([1, 2], SamplingParams(max_tokens=2), 256)[0]


def test_a_request_that_cannot_be_admitted_fails_alone_and_the_engine_goes_on():
    engine, _ = engine_with_fake_executor()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request(make_request("ok", [1, 2, 3], params))
    results: dict = {}
    collect(engine.step(), results)  # "ok" is running
    bad_requests = [
        (EngineCoreRequest("none-id", [1, None], params), "TypeError"),  # not a ValueError
        (EngineCoreRequest("n2", [1], SamplingParams(n=2)), "n must be 1"),
        (EngineCoreRequest("neg", [-1], params), "non-negative"),
        (EngineCoreRequest("vocab", [1, VOCAB_SIZE], params), "vocabulary"),
        (EngineCoreRequest("eos", [1], params, eos_token_id=-1), "eos_token_id"),
        (EngineCoreRequest("ok", [4], params), "already"),
    ]
    for request, words in bad_requests:
        with pytest.raises(ValueError, match=words):
            engine.add_request(request)
    while engine.has_unfinished_requests():
        collect(engine.step(), results)
    assert set(results) == {"ok"}
    assert results["ok"].token_ids == reference_output([1, 2, 3], params, 256)[0]
    assert_all_free(engine)
