"""Structured outputs in the scheduler: the spec's checks, and WAITING_FOR_FSM while it compiles."""

from concurrent.futures import Future

import msgspec
import pytest
from fake_executor import FakeExecutor, collect, make_request, reference_output, run_to_completion

from ember_scheduler import (
    EngineCore,
    RequestStatus,
    SamplingParams,
    SchedulerConfig,
    StructuredOutputsParams,
)

SPEC = StructuredOutputsParams(regex="[0-9]+")


class HeldCompiler:
    """A grammar compiler whose compiles finish when the test says so (one future per spec)."""

    def __init__(self) -> None:
        self.futures: dict[bytes, Future] = {}

    def compile(self, spec: StructuredOutputsParams) -> Future:
        return self.futures.setdefault(spec.cache_key(), Future())

    def finish(self, spec: StructuredOutputsParams, error: Exception | None = None) -> None:
        future = self.futures[spec.cache_key()]
        if error is None:
            future.set_result(f"compiled {spec.kind}")
        else:
            future.set_exception(error)


def _engine(compiler=None):
    executor = FakeExecutor(64, 4)
    return EngineCore(executor, SchedulerConfig(max_model_len=256), compiler)


def test_a_request_waits_for_its_grammar_while_others_run():
    compiler = HeldCompiler()
    engine = _engine(compiler)
    free_params = SamplingParams(max_tokens=6)
    constrained_params = SamplingParams(max_tokens=6, structured_outputs=SPEC)
    engine.add_request(make_request("free", [5, 6, 7], free_params))
    engine.add_request(make_request("constrained", [8, 9], constrained_params))
    request = engine.scheduler.requests["constrained"]
    assert request.status == RequestStatus.WAITING_FOR_FSM

    results = {}
    for _ in range(3):
        collect(engine.step(), results)
    assert "constrained" not in results and results["free"].token_ids
    assert request.status == RequestStatus.WAITING_FOR_FSM
    assert engine.scheduler.make_stats().num_waiting_reqs == 1

    compiler.finish(SPEC)
    more, _ = run_to_completion(engine)
    assert more["constrained"].token_ids == reference_output([8, 9], constrained_params, 256)[0]
    assert engine.kv_cache_manager.usage == 0.0


def test_a_grammar_that_fails_to_compile_aborts_only_its_request():
    compiler = HeldCompiler()
    engine = _engine(compiler)
    engine.add_request(make_request("free", [5, 6, 7], SamplingParams(max_tokens=4)))
    bad = SamplingParams(max_tokens=4, structured_outputs=SPEC)
    engine.add_request(make_request("bad", [8, 9], bad))
    compiler.finish(SPEC, ValueError("SamplingParams.structured_outputs.regex is invalid: x"))
    results, _ = run_to_completion(engine)
    assert results["bad"].finish_reason == "abort"
    assert results["bad"].finish_detail.startswith("SamplingParams.structured_outputs.regex")
    assert results["bad"].token_ids == []
    assert len(results["free"].token_ids) == 4
    assert not engine.scheduler.requests and engine.kv_cache_manager.usage == 0.0


def test_an_idle_engine_waits_for_a_compiling_grammar_without_running_the_model():
    compiler = HeldCompiler()
    engine = _engine(compiler)
    engine.add_request(make_request("c", [8, 9], SamplingParams(structured_outputs=SPEC)))
    assert engine.step().outputs == []
    assert engine.executor.scheduler_outputs == []
    assert engine.has_unfinished_requests()
    compiler.finish(SPEC)
    results, _ = run_to_completion(engine)
    assert results["c"].finish_reason in ("stop", "length")


def test_aborting_a_request_while_its_grammar_compiles():
    compiler = HeldCompiler()
    engine = _engine(compiler)
    engine.add_request(make_request("c", [8, 9], SamplingParams(structured_outputs=SPEC)))
    engine.abort_requests("c")
    assert not engine.has_unfinished_requests()
    compiler.finish(SPEC)
    assert engine.step().outputs == []


def test_structured_outputs_need_a_grammar_compiler():
    engine = _engine()
    with pytest.raises(ValueError, match="no grammar compiler"):
        engine.add_request(make_request("c", [8, 9], SamplingParams(structured_outputs=SPEC)))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "json must be a JSON schema object"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
        ({"grammar": ""}, "grammar must be a non-empty string"),
    ],
)
def test_spec_shape_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.*{message}"):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize("changes", [{"ignore_eos": True}, {"min_tokens": 2}])
def test_structured_outputs_exclude_ignore_eos_and_min_tokens(changes):
    (field,) = changes
    with pytest.raises(ValueError, match=f"SamplingParams.{field} cannot be combined"):
        SamplingParams(structured_outputs=SPEC, **changes)


def test_sampling_params_with_a_spec_survive_msgpack():
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(
            json={"type": "object"}, disable_any_whitespace=True
        )
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert decoded.structured_outputs.kind == "json"
