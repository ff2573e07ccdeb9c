"""A continuation (``EngineCoreRequest.output_token_ids``: a request moved from an engine core that
died) produces exactly the tokens the undisturbed request would have produced after them: greedy,
seeded sampling with penalties, structured outputs (the grammar replays the history), n-gram
speculation, and logprobs."""

from __future__ import annotations

import msgspec
import pytest

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.engine_factory import make_engine_core
from ember_server.engine.model_config import ModelConfig

PROMPT = [1, 447, 893, 84, 13, 447, 893, 84]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


def _core(tiny_model, **overrides):
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        kv_cache_memory=2 * 1024**2,
        block_size=4,
        **overrides,
    )
    core, _ = make_engine_core(args, ModelConfig.from_engine_args(args), served=False)
    return core


def _run(core, request: EngineCoreRequest) -> tuple[list[int], list]:
    core.add_request(request)
    tokens, logprobs = [], []
    for _ in range(500):
        for out in core.step().outputs:
            assert out.finish_detail is None, out.finish_detail
            tokens += out.new_token_ids
            if out.new_logprobs is not None:
                logprobs += out.new_logprobs.logprobs
            if out.finished:
                return tokens, logprobs
    raise AssertionError("the request did not finish")


CASES = {
    "greedy": dict(temperature=0.0, logprobs=2),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=7, frequency_penalty=0.5, min_tokens=20),
    "grammar": dict(
        temperature=1.0, seed=3, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("speculative", [False, True])
def test_a_continuation_produces_what_the_undisturbed_request_would_have(
    tiny_model, case, speculative
):
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if speculative
        else None
    )
    core = _core(tiny_model, speculative_config=spec)
    params = SamplingParams(max_tokens=24, **CASES[case])
    whole, whole_logprobs = _run(core, EngineCoreRequest("whole", PROMPT, params, eos_token_id=2))
    assert len(whole) > 8
    for cut in (1, 5, len(whole) - 1):
        moved = EngineCoreRequest(
            f"moved-{cut}", PROMPT, params, eos_token_id=2, output_token_ids=whole[:cut]
        )
        rest, rest_logprobs = _run(core, moved)
        assert whole[:cut] + rest == whole, (case, cut)
        if params.logprobs is not None:
            expected = whole_logprobs[cut:]
            assert len(rest_logprobs) == len(expected)
            for got, want in zip(rest_logprobs, expected, strict=True):
                assert got == pytest.approx(want, abs=1e-4)


def test_a_continuation_that_has_nothing_left_to_do_is_refused(tiny_model):
    core = _core(tiny_model)
    params = SamplingParams(max_tokens=3, temperature=0)
    done = EngineCoreRequest("done", PROMPT, params, output_token_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="max_tokens"):
        core.add_request(done)
    outside = EngineCoreRequest("outside", PROMPT, params, output_token_ids=[10**7])
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request(outside)


def test_the_wire_form_of_a_plain_request_is_unchanged():
    # omit_defaults: a request that is no continuation encodes as before.
    params = SamplingParams(max_tokens=3)
    plain = msgspec.msgpack.encode(EngineCoreRequest("r", PROMPT, params))
    decoded = msgspec.msgpack.decode(plain, type=EngineCoreRequest)
    assert decoded.output_token_ids == []
