"""Data parallel: the router alone, then two engine core processes behind one server."""

from __future__ import annotations

import json
import os
import random
import signal
import threading

import httpx
import pytest
from server_thread import ServerThread

from ember_kv_cache import BlockHasher, BlockHashExtras
from ember_scheduler.engine_types import KVBlocksRemoved, KVBlocksStored, KVCacheCleared
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.data_parallel import DataParallelRouter, EnginePrefixIndex
from ember_server.engine.engine_args import EngineArgs

BLOCK = 4
TIMEOUT = 60


def _router(num_engines=2, threshold=2):
    return DataParallelRouter(num_engines, BlockHasher(BLOCK), load_imbalance_threshold=threshold)


def _store(router, engine, tokens, extras=None):
    hashes = router.hasher.hash_prefix(tokens, extras)
    router.apply_events(engine, [KVBlocksStored(hashes)])
    return hashes


def test_a_request_goes_to_the_engine_holding_its_longest_prefix():
    router = _router(3)
    prompt = list(range(1, 30))
    _store(router, 2, prompt[:8])
    _store(router, 1, prompt[:16])
    decision = router.route("a", prompt)
    assert (decision.engine, decision.reason, decision.matched_blocks) == (1, "prefix", 4)
    # Only full blocks before the last token count: an engine never reuses the last one.
    assert router.route("b", prompt[:17]).matched_blocks == 4
    assert router.route("c", prompt[:16]).matched_blocks == 3


def test_the_prefix_must_match_from_the_first_block_and_with_the_same_extras():
    router = _router()
    prompt = list(range(1, 30))
    hashes = router.hasher.hash_prefix(prompt)
    router.apply_events(0, [KVBlocksStored(hashes[1:])])  # all but the first block
    assert router.route("a", prompt).reason == "load"
    _store(router, 1, prompt, BlockHashExtras(cache_salt="tenant-1"))
    assert router.route("b", prompt).reason == "load"
    salted = router.route("c", prompt, BlockHashExtras(cache_salt="tenant-1"))
    assert (salted.engine, salted.reason) == (1, "prefix")


def test_removed_and_cleared_blocks_stop_attracting_requests():
    router = _router()
    prompt = list(range(1, 30))
    hashes = _store(router, 0, prompt)
    assert router.route("a", prompt).reason == "prefix"
    router.finish("a")
    router.apply_events(0, [KVBlocksRemoved(hashes[:1])])  # evicted the head: nothing matches
    assert router.route("b", prompt).reason == "load"
    router.finish("b")
    _store(router, 0, prompt)
    router.apply_events(0, [KVCacheCleared()])
    assert router.route("c", prompt).reason == "load"


def test_a_busy_holder_loses_to_the_least_loaded_past_the_threshold():
    router = _router(threshold=2)
    prompt = list(range(1, 30))
    _store(router, 0, prompt)
    for i in range(3):  # the holder takes them while it is at most 2 ahead
        assert router.route(f"p{i}", prompt).engine == 0
    assert router.loads == [3, 0]
    decision = router.route("over", prompt)
    assert (decision.engine, decision.reason) == (1, "load")
    router.finish("p0")
    assert router.loads == [2, 1]
    assert router.route("again", prompt).reason == "prefix"


def test_ties_rotate_and_dead_engines_get_nothing():
    router = _router(3)
    engines = []
    for i in range(6):
        engines.append(router.route(f"r{i}", [1, 2, 3]).engine)
        router.finish(f"r{i}")
    assert sorted(engines) == [0, 0, 1, 1, 2, 2]
    _store(router, 1, list(range(1, 30)))
    router.route("on-1", list(range(1, 30)), load=2)
    router.mark_dead(1)
    assert router.requests_on(1) == ["on-1"]
    assert {router.route(f"s{i}", list(range(1, 30))).engine for i in range(4)} == {0, 2}
    router.mark_dead(0)
    router.mark_dead(2)
    with pytest.raises(RuntimeError, match="no engine core is alive"):
        router.route("none", [1])


def test_data_parallel_size_is_checked_and_offline_llm_refuses_it(tiny_model):
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(model="m", data_parallel_size=0)
    from ember_server.engine.llm import LLM

    with pytest.raises(ValueError, match="ember serve -dp"):
        LLM(str(tiny_model("llama")), dtype="float32", data_parallel_size=2)


# Two engine core processes behind one server -------------------------------------------------


@pytest.fixture(scope="module")
def dp_server(tiny_model):
    # A small KV pool per engine, so that a few long prompts evict a cached prefix.
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=496,  # what 2**18 bytes hold for one sequence (31 blocks and a null one)
        max_num_seqs=8,
        block_size=16,
        kv_cache_memory=2**18,
        data_parallel_size=2,
    )
    with ServerThread(args) as running:
        yield running


def _routed(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    counts = {"prefix": 0.0, "load": 0.0}
    for line in text.splitlines():
        if line.startswith("ember:dp_routed_requests_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            counts[reason] += float(line.rsplit(" ", 1)[1])
    return counts


def _generate(server, prompt, max_tokens=2):
    async def run():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = [o async for o in server.engine.generate(prompt, params, f"r{random.random()}")]
        return outputs[-1]

    return server.call(run(), timeout=TIMEOUT)


def test_a_shared_prefix_hits_its_engine_until_that_engine_evicts_it(dp_server):
    engine = dp_server.engine
    router = engine.router
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(160)]  # 10 blocks
    hashes = router.hasher.hash_prefix(prefix)

    first = _generate(dp_server, [*prefix, 1, 2, 3])
    assert first.num_cached_tokens == 0
    holders = [e for e in range(2) if router.indexes[e].count_prefix_blocks(hashes) == 10]
    assert len(holders) == 1
    holder = holders[0]

    before = _routed(dp_server)
    second = _generate(dp_server, [*prefix, 4, 5, 6])
    assert second.num_cached_tokens == 160  # served from the holder's prefix cache
    after = _routed(dp_server)
    assert after["prefix"] == before["prefix"] + 1 and after["load"] == before["load"]

    # Unrelated long prompts fill both pools (ties rotate) until the holder evicts the prefix.
    pool_tokens = engine.clients[holder].ready.num_kv_blocks * 16
    for _ in range(40):
        if router.indexes[holder].count_prefix_blocks(hashes) == 0:
            break
        filler = min(pool_tokens // 2, 500)
        _generate(dp_server, [rng.randrange(vocab) for _ in range(filler)])
    assert router.indexes[holder].count_prefix_blocks(hashes) == 0
    assert all(index.count_prefix_blocks(hashes) == 0 for index in router.indexes)

    before = _routed(dp_server)
    third = _generate(dp_server, [*prefix, 7, 8, 9])
    after = _routed(dp_server)
    assert after["load"] == before["load"] + 1 and after["prefix"] == before["prefix"]
    assert third.num_cached_tokens == 0  # the index was right: no engine held it any more


def test_a_killed_engine_that_may_not_restart_hands_its_requests_to_the_other(tiny_model):
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory=2**21,
        data_parallel_size=2,
        max_engine_restarts=0,  # the dead engine stays dead; its requests move on
    )
    body = dict(prompt="def main(argv):", max_tokens=1000, ignore_eos=True, temperature=0)
    with ServerThread(args) as server:
        base = f"{server.base_url}/v1"
        results: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            results[i] = httpx.post(f"{base}/completions", json=body, timeout=TIMEOUT)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        server.wait_for_metric("ember:num_requests_running", lambda v: v >= 2)
        router = server.engine.router
        assert router.loads == [1, 1]  # one request on each engine
        os.kill(server.engine.clients[1].pid, signal.SIGKILL)
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads)
        assert [results[i].status_code for i in range(2)] == [200, 200]
        # The moved request finished whole on engine 0: the same greedy text as the other.
        texts = [results[i].json()["choices"][0]["text"] for i in range(2)]
        assert texts[0] == texts[1] and len(texts[0]) > 0
        assert 'reason="migrated"' in httpx.get(f"{server.base_url}/metrics").text

        health = httpx.get(f"{server.base_url}/health", timeout=TIMEOUT)
        assert health.status_code == 200
        engines = health.json()["engines"]
        assert [e["alive"] for e in engines] == [True, False]
        assert "exited with code -9" in engines[1]["error"]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=TIMEOUT).text
        assert 'ember:engine_core_alive{engine="0",model_name=' in metrics
        alive = {
            line.split('engine="')[1][0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("ember:engine_core_alive{")
        }
        assert alive == {"0": 1.0, "1": 0.0}

        # The server goes on through engine 0, streaming included.
        for _ in range(3):
            response = httpx.post(
                f"{base}/completions", json={"prompt": "x", "max_tokens": 3}, timeout=TIMEOUT
            )
            assert response.status_code == 200
        with httpx.stream(
            "POST", f"{base}/completions", json={"prompt": "y", "max_tokens": 3, "stream": True},
            timeout=TIMEOUT,
        ) as stream:  # fmt: skip
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and "error" not in json.loads(lines[-2][5:])

        os.kill(server.engine.clients[0].pid, signal.SIGKILL)
        server.wait_for_metric("ember:engine_core_alive", lambda v: v == 0)
        assert httpx.get(f"{server.base_url}/health", timeout=TIMEOUT).status_code == 503


def test_the_prefix_index_mirrors_layer_group_0_only():
    """Prompts are hashed as a hybrid engine's group 0 hashes; other groups' hashes differ."""
    index = EnginePrefixIndex()
    index.apply([KVBlocksStored([b"a", b"b"]), KVBlocksStored([b"x"], group=1)])
    assert index.block_hashes == {b"a", b"b"}
    index.apply([KVBlocksRemoved([b"a"], group=1), KVBlocksRemoved([b"b"])])
    assert index.block_hashes == {b"a"}
