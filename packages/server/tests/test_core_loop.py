"""The engine core busy loop over real ZMQ sockets (inproc, in a thread): the wire protocol."""

import os
import threading

import msgspec
import pytest
import zmq

from ember_scheduler.engine_types import EngineCoreOutputs, EngineCoreRequest, FinishReason
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine import core_messages as msg
from ember_server.engine.core_process import EngineCoreProc
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.engine_factory import make_engine_core
from ember_server.engine.model_config import ModelConfig


@pytest.fixture
def wire(tiny_model):
    """(send(kind, obj), receive() -> EngineCoreOutputs, thread) around a running loop."""
    args = EngineArgs(
        model=str(tiny_model("llama")), dtype="float32", kv_cache_memory=2 * 1024**2, block_size=4
    )
    core, _ = make_engine_core(args, ModelConfig.from_engine_args(args), served=True)
    context = zmq.Context()
    router, pull = context.socket(zmq.ROUTER), context.socket(zmq.PULL)
    router.bind("inproc://input")
    pull.bind("inproc://output")
    dealer, push = context.socket(zmq.DEALER), context.socket(zmq.PUSH)
    dealer.setsockopt(zmq.IDENTITY, b"engine")
    dealer.connect("inproc://input")
    push.connect("inproc://output")
    loop = EngineCoreProc(core, dealer, push)
    thread = threading.Thread(target=loop.run, args=(os.getppid(),), daemon=True)
    thread.start()
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)

    def send(kind, obj):
        router.send_multipart([b"engine", kind, encoder.encode(obj)])

    def receive():
        assert pull.poll(30_000), "no output from the engine core"
        return decoder.decode(pull.recv())

    yield send, receive, thread, core
    send(msg.SHUTDOWN, None)
    thread.join(10)
    for socket in (router, pull, dealer, push):
        socket.close(linger=0)
    context.term()


def _request(request_id, max_tokens, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return EngineCoreRequest(request_id, [1, 447, 893, 84, 13], params, eos_token_id=2)


def _run_until_finished(receive, request_ids):
    tokens = {r: [] for r in request_ids}
    finish = {}
    stats = None
    while len(finish) < len(request_ids):
        outputs = receive()
        stats = outputs.scheduler_stats or stats
        for out in outputs.outputs:
            if out.request_id not in tokens:  # a request of an earlier phase of the test
                continue
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out
    return tokens, finish, stats


def test_add_step_and_finish_over_the_wire(wire):
    send, receive, _, _ = wire
    send(msg.ADD, _request("a", 5, logprobs=2))
    send(msg.ADD, _request("b", 3))
    tokens, finish, _ = _run_until_finished(receive, ["a", "b"])
    assert [len(tokens["a"]), len(tokens["b"])] == [5, 3]
    assert tokens["b"] == tokens["a"][:3]  # same prompt, greedy
    assert finish["a"].finish_reason == FinishReason.LENGTH


def test_abort_frees_blocks_and_reports_stats_while_idle(wire):
    send, receive, _, core = wire
    send(msg.ADD, _request("long", 200))
    first = receive()
    while not any(o.new_token_ids for o in first.outputs):
        first = receive()
    send(msg.ABORT, ["long"])
    # Once idle, the loop still answers the abort with fresh stats: nothing in use.
    stats = None
    while stats is None or stats.num_running_reqs or stats.kv_cache_usage:
        stats = receive().scheduler_stats
    assert not core.has_unfinished_requests()


def test_a_rejected_request_is_answered_not_fatal(wire):
    send, receive, thread, _ = wire
    send(msg.ADD, _request("dup", 50))
    send(msg.ADD, _request("dup", 50))
    rejected = None
    while rejected is None:
        for out in receive().outputs:
            if out.finish_reason == FinishReason.ABORT:
                rejected = out
    assert "dup" in rejected.finish_detail
    send(msg.ABORT, ["dup"])
    send(msg.ADD, _request("after", 2))
    tokens, _, _ = _run_until_finished(receive, ["after"])
    assert len(tokens["after"]) == 2 and thread.is_alive()


def _with_sampling_fields(request: EngineCoreRequest, **fields) -> dict:
    """``request`` re-encoded with raw SamplingParams values that its constructor would refuse
    (as a client other than Ember's front end could send)."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    names = [f.name for f in msgspec.structs.fields(SamplingParams)]
    for name, value in fields.items():
        raw[2][names.index(name)] = value
    return raw


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (_with_sampling_fields(_request("bad", 5), top_k=1.5), "Expected `int`"),  # no decode
        (
            _with_sampling_fields(_request("bad", 5), max_tokens=None, min_tokens=2**40),
            "min_tokens must be in [0, 2147483647]",
        ),
        # Beyond the model's vocabulary: the worker would fail the whole step on it.
        (EngineCoreRequest("bad", [1, 10**6], SamplingParams()), "vocabulary"),
        (EngineCoreRequest("bad", [1], SamplingParams(), eos_token_id=-1), "eos_token_id"),
    ],
)
def test_a_request_that_cannot_be_admitted_fails_alone(wire, bad, words):
    send, receive, thread, _ = wire
    send(msg.ADD, _request("running", 12))
    send(msg.ADD, bad)
    tokens, finish, _ = _run_until_finished(receive, ["running", "bad"])
    assert finish["bad"].finish_reason == FinishReason.ABORT and not tokens["bad"]
    assert words in finish["bad"].finish_detail
    assert len(tokens["running"]) == 12  # the request in flight went on
    assert finish["running"].finish_reason == FinishReason.LENGTH and thread.is_alive()


def test_shutdown_ends_the_loop(wire):
    send, _, thread, _ = wire
    send(msg.SHUTDOWN, None)
    thread.join(10)
    assert not thread.is_alive()
