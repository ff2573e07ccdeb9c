"""AsyncLLM against a real engine core process over ZMQ (one engine for the whole module)."""

import asyncio
import os

import numpy as np
import pytest

from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.async_llm import AsyncLLM
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.llm import LLM
from ember_server.engine.outputs import RequestOutputKind

KV_BYTES = 8 * 1024**2
PROMPTS = ["def foo(", "Grüße aus Köln", "import json\nclass", "x = [1, 2"]


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def engine(loop, model_path):
    args = EngineArgs(
        model=model_path, dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=256, block_size=4
    )
    engine = loop.run_until_complete(AsyncLLM.start(args))
    yield engine
    loop.run_until_complete(engine.shutdown())


@pytest.fixture(scope="module")
def offline(model_path):
    llm = LLM(
        model_path, dtype="float32", kv_cache_memory=KV_BYTES, max_model_len=256, block_size=4
    )
    yield llm
    llm.shutdown()


async def _collect(engine, prompt, params, request_id, stream=True):
    return [out async for out in engine.generate(prompt, params, request_id, stream=stream)]


async def _wait_for(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_streamed_greedy_equals_offline(loop, engine, offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)

    async def run():
        return await asyncio.gather(
            *(_collect(engine, p, params, f"greedy-{i}") for i, p in enumerate(PROMPTS))
        )

    for deltas, reference in zip(loop.run_until_complete(run()), expected):
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        ids = [t for d in deltas for t in d.outputs[0].token_ids]
        text = "".join(d.outputs[0].text for d in deltas)
        assert ids == reference.outputs[0].token_ids
        assert text == reference.outputs[0].text
        assert deltas[0].prompt_token_ids == reference.prompt_token_ids
        assert deltas[-1].outputs[0].finish_reason == "length"


def test_final_only_n2_with_logprobs(loop, engine, offline):
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=6, logprobs=2)
    (final,) = loop.run_until_complete(_collect(engine, "def foo(", params, "n2", stream=False))
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    (reference,) = offline.generate("def foo(", params, use_tqdm=False)
    for got, want in zip(final.outputs, reference.outputs):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert len(got.logprobs) == 6
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


def test_streamed_n2_tags_each_delta_with_its_sequence(loop, engine):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=5)
    deltas = loop.run_until_complete(_collect(engine, "x = [1, 2", params, "n2-stream"))
    per_index = {0: [], 1: []}
    for delta in deltas:  # a delta the consumer was late for holds both sequences' news
        for completion in delta.outputs:
            per_index[completion.index].extend(completion.token_ids)
    assert [len(v) for v in per_index.values()] == [5, 5]
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1


def test_cumulative_outputs_grow(loop, engine, offline):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run():
        stream = engine.generate(
            "def foo(", params, "cumulative", output_kind=RequestOutputKind.CUMULATIVE
        )
        return [out async for out in stream]

    outputs = loop.run_until_complete(run())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]  # a late consumer skips ahead
    assert lengths == sorted(set(lengths)) and lengths[-1] == 5
    expected = offline.generate("def foo(", params, use_tqdm=False)[0].outputs[0]
    assert outputs[-1].outputs[0].token_ids == expected.token_ids
    assert outputs[-1].outputs[0].text == expected.text


def test_stop_string_never_streams(loop, engine, offline):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = offline.generate("def foo(", params, use_tqdm=False)[0].outputs[0].text
    stop = full[4:7]
    deltas = loop.run_until_complete(
        _collect(engine, "def foo(", params.clone(stop=[stop]), "stop")
    )
    text = "".join(d.outputs[0].text for d in deltas)
    assert text == full[: full.index(stop)]
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    loop.run_until_complete(_wait_for(lambda: engine.scheduler_stats.num_running_reqs == 0))


def test_leaving_the_stream_aborts_and_frees_kv(loop, engine):
    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = engine.generate("import json\nclass", params, "leave")
        async for _ in stream:
            break
        await stream.aclose()
        await _wait_for(lambda: engine.scheduler_stats.kv_cache_usage == 0.0)
        assert not engine.output_processor.has_unfinished_requests()

        outputs = []

        async def consume():
            async for out in engine.generate("x = [1", params, "external"):
                outputs.append(out)

        task = asyncio.ensure_future(consume())
        await _wait_for(lambda: outputs)
        await engine.abort("external")
        await asyncio.wait_for(task, 10)
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        await _wait_for(lambda: engine.scheduler_stats.kv_cache_usage == 0.0)

    loop.run_until_complete(run())


def test_bad_input_fails_at_the_call_while_others_run(loop, engine, offline):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run():
        good = engine.generate("def foo(", params, "good")
        outputs = [await anext(good)]
        with pytest.raises(ValueError, match="context length"):
            engine.generate("a " * 400, params, "too-long")
        with pytest.raises(ValueError, match="prompt_token_ids"):
            engine.generate([1, 10**6], params, "bad-ids")
        # Values changed after SamplingParams was built are checked again at the call: a float
        # where the engine wants an int, a count beyond the engine's int32 columns.
        for name, value, words in (
            ("top_k", 1.5, "top_k must be an int"),
            ("min_tokens", 2**40, r"min_tokens must be in \[0, 2147483647\]"),
        ):
            bad = params.clone(max_tokens=None)
            setattr(bad, name, value)
            with pytest.raises(ValueError, match=rf"SamplingParams\.{words}"):
                engine.generate("x", bad, "bad-value")
        with pytest.raises(ValueError, match="already in flight"):
            engine.generate("x", params, "good")
        outputs += [out async for out in good]
        return outputs

    deltas = loop.run_until_complete(run())
    expected = offline.generate("def foo(", params, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected


def test_metrics_follow_the_requests(loop, engine):
    before = engine.metrics.generation_tokens._value.get()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    loop.run_until_complete(_collect(engine, "def foo(", params, "metrics"))
    assert engine.metrics.generation_tokens._value.get() - before == 4
    text = engine.metrics.render().decode()
    for name in (
        "ember:time_to_first_token_seconds_count",
        "ember:inter_token_latency_seconds_count",
        "ember:e2e_request_latency_seconds_count",
        "ember:prompt_tokens_total",
        "ember:kv_cache_usage_perc",
        "ember:prefix_cache_hits_total",
        'ember:request_success_total{finished_reason="length"',
    ):
        assert name in text


def test_encode_matches_offline_and_cancelling_or_aborting_it_frees_kv(loop, engine, offline):
    long_prompt = "import json\nclass " * 40

    async def run():
        outputs = await asyncio.gather(
            *(engine.encode(p, PoolingParams(), f"embed-{i}") for i, p in enumerate(PROMPTS))
        )
        expected = offline.embed(PROMPTS, use_tqdm=False)
        for output, want in zip(outputs, expected):
            np.testing.assert_allclose(output.outputs.data, want.outputs.embedding, atol=1e-5)
        with pytest.raises(ValueError, match="cannot classify"):
            await engine.encode("x", PoolingParams(task="classify"), "no-head")

        # One loop turn: each call has registered its request and is sending it to the engine.
        cancelled = asyncio.ensure_future(engine.encode(long_prompt, PoolingParams(), "cancel"))
        await asyncio.sleep(0)
        assert "cancel" in engine.output_processor.pooling_requests
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        aborted = asyncio.ensure_future(engine.encode(long_prompt, PoolingParams(), "abort"))
        await asyncio.sleep(0)
        await engine.abort("abort")
        with pytest.raises(ValueError, match="was aborted"):
            await asyncio.wait_for(aborted, 10)
        await _wait_for(lambda: engine.scheduler_stats.kv_cache_usage == 0.0)
        assert not engine.output_processor.has_unfinished_requests()

    loop.run_until_complete(run())


def test_a_finished_request_leaves_no_queue_even_if_its_consumer_stops_reading(loop, engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run():
        stream = engine.generate("x = [1", params, "unread")
        await anext(stream)  # registered; then neither read on nor closed for a while
        await _wait_for(lambda: "unread" not in engine._queues)
        await stream.aclose()
        assert "unread" not in engine._queues

    loop.run_until_complete(run())


def test_shutdown_stops_the_process(loop, engine):
    pid = engine.engine_core_pid
    assert engine.is_healthy()
    loop.run_until_complete(engine.shutdown())
    assert not engine.is_healthy()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
