import msgspec

from ember_scheduler import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SamplingParams,
    SchedulerStats,
)


def test_wire_types_round_trip_through_msgpack():
    request = EngineCoreRequest("a", [1, 2], SamplingParams(max_tokens=3), 0, 1.5, 2, "salt")
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest) == request
    )
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [5], Logprobs([[5, 6]], [[-0.1, -2.0]], [1])),
            EngineCoreOutput(
                "b", [], finish_reason=FinishReason.IGNORED, finish_detail="prompt too long"
            ),
            EngineCoreOutput("c", [9], finish_reason=FinishReason.STOP, stop_reason=9),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, num_preemptions=1),
        timestamp=3.0,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded == outputs
    assert decoded.outputs[1].finished and not decoded.outputs[0].finished
    assert decoded.outputs[1].finish_detail == "prompt too long"
    assert [str(o.finish_reason) for o in decoded.outputs[1:]] == ["ignored", "stop"]
