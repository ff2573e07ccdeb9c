"""Async scheduling: step n+1 is scheduled before step n's output is applied, and stops, aborts
and preemption stay exact."""

import threading
from concurrent.futures import Future

import pytest
from fake_executor import (
    EOS_TOKEN_ID,
    FakeExecutor,
    collect,
    make_request,
    next_token,
    reference_output,
    run_to_completion,
)

from ember_scheduler import EngineCore, SamplingParams, SchedulerConfig

MAX_MODEL_LEN = 64


class GatedExecutor(FakeExecutor):
    """Runs each step on a thread that first waits for the test to open that step's gate."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gates: list[threading.Event] = []
        self.submitted = threading.Semaphore(0)

    def execute_model(self, so, non_block=False):
        assert non_block
        gate = threading.Event()
        self.gates.append(gate)
        future: Future = Future()
        previous = self.gates[-2] if len(self.gates) > 1 else None

        def run():
            gate.wait(10)
            if previous is not None:
                assert previous.is_set(), "steps ran out of order"
            future.set_result(self._execute(so))

        threading.Thread(target=run, daemon=True).start()
        self.submitted.release()
        return future


def _engine(executor, **config) -> EngineCore:
    config = SchedulerConfig(max_model_len=MAX_MODEL_LEN, async_scheduling=True, **config)
    return EngineCore(executor, config)


def test_step_n_plus_1_is_scheduled_before_step_n_output_is_applied():
    executor = GatedExecutor(64, 4)
    engine = _engine(executor)
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(make_request("a", prompt, params))
    request = engine.scheduler.requests["a"]

    assert engine.step().outputs == []  # step 1 handed over, not waited for
    assert request.num_output_placeholders == 1

    results: dict = {}
    stepper = threading.Thread(target=lambda: collect(engine.step(), results))
    stepper.start()
    assert executor.submitted.acquire(timeout=10)  # step 1's gate
    assert executor.submitted.acquire(timeout=10)  # step 2 scheduled while step 1 is blocked
    assert executor.scheduler_outputs == []  # the fake runs a step once its gate opens
    assert request.output_token_ids == []  # step 1's output is not applied yet
    assert request.num_output_placeholders == 2
    assert request.num_computed_tokens == len(prompt) + 1  # step 2 feeds step 1's token
    assert stepper.is_alive()  # waiting for step 1

    executor.gates[0].set()
    stepper.join(10)
    assert results["a"].token_ids == [next_token(prompt)]
    assert request.num_output_placeholders == 1
    for gate in executor.gates:
        gate.set()
    while engine.has_unfinished_requests():
        for gate in executor.gates:
            gate.set()
        collect(engine.step(), results)
    want, _, _ = reference_output(prompt, params, MAX_MODEL_LEN)
    assert results["a"].token_ids == want and results["a"].finish_reason == "length"
    # max_tokens=4: never scheduled to sample a fifth token.
    sampling_steps = [so for so in executor.scheduler_outputs if "a" in so.num_scheduled_tokens]
    assert len(sampling_steps) == 4


def _eos_prompt() -> tuple[list[int], int]:
    """A prompt whose continuation reaches EOS after a few tokens, and that count."""
    for first in range(1, 97):
        prompt = [first, 3]
        tokens, reason, _ = reference_output(prompt, SamplingParams(max_tokens=40), 200)
        if reason == "stop" and 2 <= len(tokens) <= 30:
            return prompt, len(tokens)
    raise AssertionError("no prompt reaches EOS")


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens", "context"])
def test_a_stopped_request_shows_no_token_of_the_step_after_its_stop(stop):
    prompt, num_to_eos = _eos_prompt()
    if stop == "eos":
        params = SamplingParams(max_tokens=40)
    elif stop == "stop_token":
        tokens, _, _ = reference_output(prompt, SamplingParams(max_tokens=5, ignore_eos=True), 99)
        params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[tokens[2]])
    elif stop == "max_tokens":
        params = SamplingParams(max_tokens=3, ignore_eos=True)
    else:
        params = SamplingParams(ignore_eos=True)
    executor = FakeExecutor(64, 4)
    engine = _engine(executor)
    engine.add_request(make_request("a", prompt, params))
    # A second request keeps the engine stepping after "a" stopped.
    engine.add_request(make_request("b", [9, 9], SamplingParams(max_tokens=50, ignore_eos=True)))
    results, _ = run_to_completion(engine)
    want = reference_output(prompt, params, engine.scheduler.max_num_tokens)
    got = results["a"]
    assert (got.token_ids, got.finish_reason, got.stop_reason) == want
    if stop == "eos":
        assert got.token_ids[-1] == EOS_TOKEN_ID and len(got.token_ids) == num_to_eos
    # Never scheduled past max_tokens or the context: the worker would hold a token too many.
    last = max(
        so.scheduled_cached_reqs.num_computed_tokens[so.scheduled_cached_reqs.req_ids.index("a")]
        + so.num_scheduled_tokens["a"]
        for so in executor.scheduler_outputs
        if "a" in so.scheduled_cached_reqs.req_ids
    )
    assert last <= len(prompt) + min(params.max_tokens or MAX_MODEL_LEN, MAX_MODEL_LEN)
    assert engine.kv_cache_manager.usage == 0.0


def test_an_abort_between_schedule_and_output_frees_the_blocks_once():
    executor = FakeExecutor(32, 4)
    engine = _engine(executor)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request(make_request("a", list(range(1, 10)), params))
    engine.add_request(make_request("b", [4, 5], params))
    first: dict = {}
    collect(engine.step(), first)  # step 1 in flight
    collect(engine.step(), first)  # step 2 in flight, step 1 applied
    free_before = engine.kv_cache_manager.num_free_blocks
    engine.abort_requests("a")  # step 2 of "a" is in flight
    assert engine.kv_cache_manager.num_free_blocks > free_before
    results, _ = run_to_completion(engine)  # step 2's output for "a" is dropped
    assert "a" not in results
    assert (
        first["b"].token_ids + results["b"].token_ids
        == reference_output([4, 5], params, MAX_MODEL_LEN)[0]
    )
    kv = engine.kv_cache_manager
    assert kv.usage == 0.0 and kv.num_free_blocks == 31
    dropped = [so for so in executor.scheduler_outputs if "a" in so.finished_req_ids]
    assert len(dropped) == 1  # the worker is told once


def test_a_request_preempted_with_a_step_in_flight_keeps_that_token():
    # 3 blocks of 4 tokens for two requests that each grow to 9 tokens: one is preempted.
    executor = FakeExecutor(4, 4)
    engine = _engine(executor, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request(make_request("a", [1, 2, 3], params))
    engine.add_request(make_request("b", [4, 5, 6], params))
    results: dict = {}
    preempted_in_flight = False
    while engine.has_unfinished_requests():
        before = {r.request_id: r.num_output_placeholders for r in engine.scheduler.running}
        collect(engine.step(), results)
        for so in executor.scheduler_outputs[-1:]:
            for rid in so.preempted_req_ids:
                preempted_in_flight |= before.get(rid, 0) > 0
                request = engine.scheduler.requests.get(rid)
                if request is not None:  # resumed only once its token is known
                    assert request.num_output_placeholders == 0
    assert preempted_in_flight
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        assert results[rid].token_ids == reference_output(prompt, params, MAX_MODEL_LEN)[0]
    assert engine.kv_cache_manager.usage == 0.0


def test_prompt_logprobs_survive_a_preemption_with_a_chunk_in_flight():
    executor = FakeExecutor(5, 2)
    # "b"'s first chunk is in flight when "a"'s decode needs its block.
    engine = _engine(executor, max_num_batched_tokens=4, max_num_seqs=2)
    params = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9, 10, 11]}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, params))
    results, stats = run_to_completion(engine)
    assert sum(s.num_preemptions for s in stats) > 0
    for rid, prompt in prompts.items():
        assert results[rid].prompt_logprob_token_ids == prompt[1:]
        want = reference_output(prompt, params, engine.scheduler.max_num_tokens)[0]
        assert results[rid].token_ids == want


def test_an_engine_whose_last_request_stopped_holds_no_step_in_flight():
    prompt, _ = _eos_prompt()
    engine = _engine(FakeExecutor(64, 4))
    engine.add_request(make_request("a", prompt, SamplingParams(max_tokens=40)))
    results: dict = {}
    while "a" not in results or results["a"].finish_reason is None:
        collect(engine.step(), results)
    assert results["a"].finish_reason == "stop"
    # The step scheduled after the stop ran; its output was waited for and dropped.
    assert not engine.has_unfinished_requests() and not engine.batch_queue
