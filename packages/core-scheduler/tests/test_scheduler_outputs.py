"""Scheduler outputs, driven through EngineCore with the deterministic fake executor: stop
conditions, speculative tokens and their rollback, logprobs, stats."""

import pytest
from fake_executor import (
    EOS_TOKEN_ID,
    assert_all_free,
    collect,
    engine_with_fake_executor,
    make_request,
    next_token,
    random_prompts,
    reference_output,
    run_to_completion,
)

from ember_scheduler import (
    FinishReason,
    SamplingParams,
)


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
    engine, executor = engine_with_fake_executor(max_model_len=24)
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
    engine, executor = engine_with_fake_executor(
        num_blocks=32,
        block_size=4,
        num_spec_tokens=num_spec_tokens,
        num_lookahead_tokens=num_spec_tokens,
        max_num_batched_tokens=32,
    )
    prompts = random_prompts(6, seed=3)
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
    assert_all_free(engine)


def test_stops_inside_an_accepted_run_truncate_it_and_drafts_are_counted():
    engine, executor = engine_with_fake_executor(
        num_blocks=32,
        block_size=4,
        num_spec_tokens=3,
        num_lookahead_tokens=3,
        max_num_batched_tokens=32,
        max_model_len=40,
    )
    prompts = random_prompts(8, seed=5)
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
    assert_all_free(engine)


def test_logprobs_follow_their_tokens_and_prompt_logprobs_survive_preemption():
    engine, _ = engine_with_fake_executor(num_blocks=9, block_size=4, max_num_batched_tokens=8)
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
    engine, _ = engine_with_fake_executor()
    engine.add_request(make_request("a", [1, 2, 3], SamplingParams(max_tokens=3)))
    results, _ = run_to_completion(engine)
    assert results["a"].logprob_token_ids == [] and len(results["a"].token_ids) >= 1


def test_stats_and_idle_steps():
    engine, _ = engine_with_fake_executor()
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
