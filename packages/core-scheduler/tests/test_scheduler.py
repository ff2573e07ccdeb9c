"""Scheduler behaviour, driven through EngineCore with the deterministic fake executor."""

import random

import pytest
from fake_executor import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    FakeExecutor,
    collect,
    make_request,
    next_token,
    reference_output,
    run_to_completion,
)

from ember_scheduler import (
    EngineCore,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    SchedulerConfig,
)


def _engine(num_blocks=64, block_size=4, num_spec_tokens=0, **config):
    config.setdefault("max_model_len", 256)
    executor = FakeExecutor(num_blocks, block_size, num_spec_tokens=num_spec_tokens)
    return EngineCore(executor, SchedulerConfig(**config)), executor


def _prompts(count, seed=0, max_len=40):
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(1, 97) for _ in range(rng.randrange(1, max_len))]
        for i in range(count)
    }


def _assert_all_free(engine):
    kv = engine.kv_cache_manager
    assert kv.usage == 0.0
    assert kv.num_free_blocks == engine.scheduler.num_kv_blocks
    assert not engine.scheduler.requests and not engine.scheduler.running


def test_outputs_match_the_reference_and_blocks_are_freed():
    engine, _ = _engine()
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=24)
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params))
    results, _ = run_to_completion(engine)
    for rid, prompt in prompts.items():
        tokens, reason, stop_reason = reference_output(prompt, params, 256)
        assert results[rid].token_ids == tokens
        assert results[rid].finish_reason == reason
        assert results[rid].stop_reason == stop_reason
    _assert_all_free(engine)


def test_chunked_prefill_never_exceeds_the_budget_or_the_threshold():
    engine, executor = _engine(
        num_blocks=128, max_num_batched_tokens=24, long_prefill_token_threshold=10
    )
    prompts = _prompts(8, seed=1, max_len=90)
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
    engine, executor = _engine(
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
    engine, executor = _engine(num_blocks=64, block_size=4)
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
    engine, _ = _engine()
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
    engine, executor = _engine(num_blocks=64, block_size=4)
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
    engine, executor = _engine(num_blocks=9, block_size=4, max_num_seqs=4)  # 8 usable blocks
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
    _assert_all_free(engine)


def test_priority_order_is_honoured():
    engine, executor = _engine(max_num_seqs=1, policy="priority")
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
    engine, executor = _engine(num_blocks=7, block_size=4, policy="priority")  # 6 usable blocks
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
    _assert_all_free(engine)


def test_abort_frees_blocks_at_once_and_tells_the_worker():
    engine, executor = _engine()
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
    _assert_all_free(engine)


def test_abort_of_a_waiting_request():
    engine, executor = _engine(max_num_seqs=1)
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
    engine, _ = _engine(num_blocks=blocks, block_size=4, max_num_seqs=2)
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
    _assert_all_free(engine)


def test_duplicate_request_ids_are_rejected_without_harm():
    engine, _ = _engine()
    engine.add_request(make_request("a", [1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(make_request("a", [3, 4], SamplingParams(max_tokens=2)))
    results, _ = run_to_completion(engine)
    assert results["a"].token_ids == reference_output([1, 2], SamplingParams(max_tokens=2), 256)[0]


def test_a_request_that_cannot_be_admitted_fails_alone_and_the_engine_goes_on():
    engine, _ = _engine()
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
    _assert_all_free(engine)


def _prompt_reaching_eos_after(min_steps):
    """A two-token prompt after which the fake model emits EOS as its output number > min_steps."""
    for a in range(1, 97):
        for b in range(1, 97):
            seq = [a, b]
            while len(seq) < 10 and seq[-1] != EOS_TOKEN_ID:
                seq.append(next_token(seq))
            step = len(seq) - 3
            if seq[-1] == EOS_TOKEN_ID and step >= min_steps and EOS_TOKEN_ID not in seq[2:-1]:
                return [a, b], step
    raise AssertionError("no prompt found")


def test_stop_conditions():
    prompt, eos_index = _prompt_reaching_eos_after(2)
    before_eos = reference_output(prompt, SamplingParams(max_tokens=20), 256)[0][:-1]
    stop_id = before_eos[-1]
    cases = {
        "eos": SamplingParams(max_tokens=20),
        "ignore_eos": SamplingParams(max_tokens=eos_index + 3, ignore_eos=True),
        "min_tokens": SamplingParams(max_tokens=20, min_tokens=eos_index + 2),
        "max_tokens": SamplingParams(max_tokens=eos_index, ignore_eos=True),
        "stop_token": SamplingParams(max_tokens=20, stop_token_ids=[stop_id]),
    }
    engine, executor = _engine(max_model_len=24)
    for rid, params in cases.items():
        engine.add_request(make_request(rid, prompt, params))
    engine.add_request(
        make_request("model_len", [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True))
    )
    results, _ = run_to_completion(engine)
    # The worker learns each request's EOS (for the sampler's min_tokens mask); none if ignored.
    sent_eos = {
        n.req_id: n.eos_token_id for so in executor.scheduler_outputs for n in so.scheduled_new_reqs
    }
    assert sent_eos == {
        "eos": EOS_TOKEN_ID,
        "ignore_eos": None,
        "min_tokens": EOS_TOKEN_ID,
        "max_tokens": None,
        "stop_token": EOS_TOKEN_ID,
        "model_len": None,
    }
    eos = results["eos"]
    assert (eos.token_ids[-1], eos.finish_reason, eos.stop_reason) == (EOS_TOKEN_ID, "stop", None)
    assert len(eos.token_ids) == eos_index + 1
    assert results["ignore_eos"].token_ids[eos_index] == EOS_TOKEN_ID
    assert len(results["ignore_eos"].token_ids) == eos_index + 3
    assert len(results["min_tokens"].token_ids) >= eos_index + 2
    assert results["max_tokens"].token_ids == before_eos[:eos_index]
    assert results["max_tokens"].finish_reason == "length"
    stop = results["stop_token"]
    assert (stop.finish_reason, stop.stop_reason) == ("stop", stop_id)
    assert stop.token_ids[-1] == stop_id and len(stop.token_ids) <= eos_index
    assert len(results["model_len"].token_ids) == 21
    assert results["model_len"].finish_reason == "length"
    for rid, params in cases.items():
        tokens, reason, _ = reference_output(prompt, params, 24)
        assert (results[rid].token_ids, results[rid].finish_reason) == (tokens, reason)


@pytest.mark.parametrize("num_spec_tokens", [1, 3])
def test_speculative_tokens_get_slots_and_rejections_roll_back(num_spec_tokens):
    engine, executor = _engine(
        num_blocks=32,
        block_size=4,
        num_spec_tokens=num_spec_tokens,
        num_lookahead_tokens=num_spec_tokens,
        max_num_batched_tokens=32,
    )
    prompts = _prompts(6, seed=3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params))
    results, _ = run_to_completion(engine)
    spec_steps = [so for so in executor.scheduler_outputs if so.scheduled_spec_decode_tokens]
    assert spec_steps
    for so in spec_steps:
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert so.num_scheduled_tokens[rid] <= len(drafts) + 1
    multi = sum(1 for so in spec_steps for t in so.num_scheduled_tokens.values() if t > 1)
    assert multi  # several tokens verified at once
    for rid, prompt in prompts.items():
        assert results[rid].token_ids == reference_output(prompt, params, 256)[0]
    _assert_all_free(engine)


def test_stops_inside_an_accepted_run_truncate_it_and_drafts_are_counted():
    engine, executor = _engine(
        num_blocks=32,
        block_size=4,
        num_spec_tokens=3,
        num_lookahead_tokens=3,
        max_num_batched_tokens=32,
        max_model_len=40,
    )
    prompts = _prompts(8, seed=5)
    cases = {
        rid: SamplingParams(max_tokens=[5, 9, 30][i % 3], stop_token_ids=[i % 7 + 1])
        for i, rid in enumerate(prompts)
    }
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, cases[rid]))
    results, stats = run_to_completion(engine)
    for rid, prompt in prompts.items():
        tokens, reason, _ = reference_output(prompt, cases[rid], 40)
        assert (results[rid].token_ids, results[rid].finish_reason) == (tokens, reason)
    scheduled = [
        d for so in executor.scheduler_outputs for d in so.scheduled_spec_decode_tokens.values()
    ]
    spec = [s.spec_decoding for s in stats if s.spec_decoding is not None]
    assert sum(s.num_drafts for s in spec) == len(scheduled) > 0
    assert sum(s.num_draft_tokens for s in spec) == sum(len(d) for d in scheduled)
    accepted = sum(s.num_accepted_tokens for s in spec)
    assert 0 < accepted < sum(len(d) for d in scheduled)
    per_pos = [sum(p) for p in zip(*(s.num_accepted_tokens_per_pos + [0] * 3 for s in spec))]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    _assert_all_free(engine)


def test_logprobs_follow_their_tokens_and_prompt_logprobs_survive_preemption():
    engine, _ = _engine(num_blocks=9, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=12, logprobs=1, prompt_logprobs=0, ignore_eos=True)
    prompts = {"a": list(range(1, 14)), "b": list(range(40, 53))}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params))
    results, stats = run_to_completion(engine)
    assert sum(s.num_preemptions for s in stats) > 0
    for rid, prompt in prompts.items():
        assert results[rid].logprob_token_ids == results[rid].token_ids
        assert results[rid].prompt_logprob_token_ids == prompt[1:]
        assert results[rid].token_ids == reference_output(prompt, params, 256)[0]


def test_no_logprobs_unless_asked():
    engine, _ = _engine()
    engine.add_request(make_request("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    results, _ = run_to_completion(engine)
    assert results["a"].logprob_token_ids == [] and len(results["a"].token_ids) >= 1


def test_stats_and_idle_steps():
    engine, _ = _engine()
    outputs = engine.step()
    assert outputs.outputs == [] and outputs.scheduler_stats.num_running_reqs == 0
    engine.add_request(make_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    engine.add_request(make_request("b", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    outputs = engine.step()
    stats = outputs.scheduler_stats
    assert stats.num_running_reqs == 2 and stats.num_waiting_reqs == 0 and stats.kv_cache_usage > 0
    assert stats.num_unfinished_reqs == 2
    results: dict = {}
    collect(outputs, results)
    assert outputs.outputs[0].finish_reason is None
    assert engine.reset_prefix_cache() is False  # blocks in use
    _, stats = run_to_completion(engine)
    assert stats[-1].num_unfinished_reqs == 0
    assert engine.reset_prefix_cache() is True
    engine.shutdown()
    assert engine.executor.is_shut_down
    assert FinishReason.IGNORED.__str__() == "ignored"
