"""OutputProcessor on hand-made engine core outputs (no model needed)."""

import pytest

from ember_scheduler.engine_types import EngineCoreOutput, FinishReason
from ember_scheduler.outputs import Logprobs
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.metrics import IterationStats
from ember_server.engine.output_processor import OutputProcessor
from ember_server.engine.outputs import RequestOutputKind


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def _add(processor, inputs, request_id, params, kind, prompt="hello"):
    text, ids = inputs.tokenize(prompt)
    engine_requests = inputs.make_requests(request_id, ids, params)
    processor.add_request(request_id, text, params, engine_requests, kind)
    return engine_requests


def test_children_share_the_prompt_with_distinct_seeds(inputs):
    params = SamplingParams(n=3, seed=10, prompt_logprobs=1, stop_token_ids=[5])
    children = inputs.make_requests("req", [1, 2, 3], params)
    assert [c.request_id for c in children] == ["0_req", "1_req", "2_req"]
    assert all(c.prompt_token_ids == [1, 2, 3] for c in children)
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    assert all(c.sampling_params.n == 1 for c in children)
    # generation_config's further EOS ids become stop token ids (unless ignore_eos).
    assert all(c.sampling_params.stop_token_ids == [5, 7] for c in children)
    assert (
        inputs.make_requests("r", [1], SamplingParams(ignore_eos=True))[
            0
        ].sampling_params.stop_token_ids
        == []
    )


def test_prompt_beyond_the_kv_cache_is_refused(inputs):
    with pytest.raises(ValueError, match="KV cache"):
        inputs.make_requests("r", list(range(3, 45)), SamplingParams())


def test_delta_outputs_per_sequence_and_stop_string_abort(tokenizer, inputs):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, stop=["world"])
    _add(processor, inputs, "req", params, RequestOutputKind.DELTA)
    hello, world = _ids(tokenizer, "hello"), _ids(tokenizer, " world")
    stats = IterationStats()
    step = processor.process_outputs(
        [EngineCoreOutput("0_req", hello), EngineCoreOutput("1_req", hello)], stats
    )
    assert [(o.outputs[0].index, o.finished) for o in step.request_outputs] == [
        (0, False),
        (1, False),
    ]
    # The last len("world") - 1 characters wait until they cannot start the stop string.
    assert [o.outputs[0].text for o in step.request_outputs] == ["h", "h"]
    assert stats.num_generation_tokens == 2 * len(hello) and len(stats.time_to_first_tokens) == 2
    step = processor.process_outputs([EngineCoreOutput("1_req", world)])
    assert step.reqs_to_abort == ["1_req"]
    (out,) = step.request_outputs
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "world"
    assert out.outputs[0].token_ids == world and not out.finished
    step = processor.process_outputs(
        [EngineCoreOutput("0_req", [2], finish_reason=FinishReason.STOP, stop_reason=None)]
    )
    (out,) = step.request_outputs
    assert out.finished and out.outputs[0].text == "ello" and out.outputs[0].finish_reason == "stop"
    assert not processor.has_unfinished_requests()
    # Outputs for a request that is gone are ignored.
    assert processor.process_outputs([EngineCoreOutput("0_req", [5])]).request_outputs == []


def test_final_only_gathers_every_sequence_once(tokenizer, inputs):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, logprobs=1)
    _add(processor, inputs, "req", params, RequestOutputKind.FINAL_ONLY)
    rows = Logprobs(token_ids=[[5, 5]], logprobs=[[-0.5, -0.5]], ranks=[1])
    assert not processor.process_outputs(
        [EngineCoreOutput("1_req", [5], new_logprobs=rows, finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    (out,) = processor.process_outputs(
        [EngineCoreOutput("0_req", [5], new_logprobs=rows, finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert all(c.token_ids == [5] and c.cumulative_logprob == -0.5 for c in out.outputs)
    assert out.outputs[0].logprobs[0][5].rank == 1


def test_cumulative_and_prompt_logprobs_in_chunks(tokenizer, inputs):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(prompt_logprobs=0)
    engine_requests = _add(
        processor, inputs, "req", params, RequestOutputKind.CUMULATIVE, "a b c d"
    )
    num_prompt = len(engine_requests[0].prompt_token_ids)
    ids = engine_requests[0].prompt_token_ids
    first = Logprobs([[t] for t in ids[1:3]], [[-1.0]] * 2, [1, 1])
    rest = Logprobs([[t] for t in ids[3:]], [[-2.0]] * (num_prompt - 3), [1] * (num_prompt - 3))
    assert not processor.process_outputs(
        [EngineCoreOutput("req", [], new_prompt_logprobs=first)]
    ).request_outputs
    (out,) = processor.process_outputs(
        [EngineCoreOutput("req", [5], new_prompt_logprobs=rest)]
    ).request_outputs
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == num_prompt
    assert [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])] == [-1.0] * 2 + [
        -2.0
    ] * (num_prompt - 3)
    (out,) = processor.process_outputs([EngineCoreOutput("req", [6])]).request_outputs
    assert out.outputs[0].token_ids == [5, 6] and out.prompt_logprobs is not None


def test_abort_returns_a_final_output(tokenizer, inputs):
    processor = OutputProcessor(tokenizer)
    _add(processor, inputs, "req", SamplingParams(n=2), RequestOutputKind.DELTA)
    processor.process_outputs([EngineCoreOutput("0_req", [5], finish_reason=FinishReason.LENGTH)])
    engine_ids, finals = processor.abort_requests(["req", "unknown"])
    assert engine_ids == ["1_req"]
    (final,) = finals
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_abort_reports_every_sequence(tokenizer, inputs, kind):
    processor = OutputProcessor(tokenizer)
    _add(processor, inputs, "req", SamplingParams(n=2), kind)
    _, outputs = processor.abort_requests(["req"])
    assert [o.finished for o in outputs] == [False, True][-len(outputs) :]
    reported = {c.index: c.finish_reason for o in outputs for c in o.outputs}
    assert reported == {0: "abort", 1: "abort"}


def test_priority_needs_the_priority_policy(inputs):
    with pytest.raises(ValueError, match="scheduling_policy"):
        inputs.make_requests("r", [1, 2], SamplingParams(), priority=3)
    assert inputs.make_requests("r", [1, 2], SamplingParams(), priority=0)


@pytest.mark.parametrize(
    ("seed", "children"),
    [(2**63 - 1, [2**63 - 1, -(2**63), -(2**63) + 1]), (-1, [-1, 0, 1]), (None, [None] * 3)],
)
def test_child_seeds_wrap_within_int64_so_every_valid_seed_is_served(inputs, seed, children):
    requests = inputs.make_requests("r", [1, 2], SamplingParams(n=3, seed=seed))
    assert [r.sampling_params.seed for r in requests] == children


def test_output_room_is_the_one_length_limit(inputs):
    # max_model_len 64, KV capacity 40 tokens: the smaller one binds.
    assert inputs.output_room(1) == 39 and inputs.output_room(39) == 1
    with pytest.raises(ValueError, match="KV cache holds 40 tokens"):
        inputs.output_room(40)
    inputs.max_num_kv_tokens = None
    assert inputs.output_room(40) == 24
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        inputs.output_room(64)


@pytest.mark.parametrize("reason", [FinishReason.IGNORED, FinishReason.ABORT])
def test_a_request_the_engine_refuses_fails_alone(tokenizer, inputs, reason):
    processor = OutputProcessor(tokenizer)
    _add(processor, inputs, "bad", SamplingParams(n=2), RequestOutputKind.DELTA)
    _add(processor, inputs, "good", SamplingParams(), RequestOutputKind.DELTA)
    refused = EngineCoreOutput("1_bad", [], finish_reason=reason, finish_detail="cannot admit")
    done = EngineCoreOutput("good", [5], finish_reason=FinishReason.LENGTH)
    processed = processor.process_outputs([refused, done])
    assert processed.request_errors == {"bad": "cannot admit"}
    assert processed.reqs_to_abort == ["0_bad"]  # its sibling stops too
    assert [o.request_id for o in processed.request_outputs] == ["good"]
    assert not processor.has_unfinished_requests()
