"""The scheduler with a tiered KV connector, over the fake executor's token-id KV cache.

The fake worker saves chunks of its cache to a real ``TieredKVStore`` and loads them back into a
request's blocks; its forward asserts that the cache holds the right tokens, so a wrong load,
a block cached before its KV arrived, or a wrong computed count fails.
"""

from __future__ import annotations

import random

import pytest
from fake_executor import FakeExecutor, make_request, reference_output, run_to_completion

from ember_kv_cache import CPUTier, KVTransferConfig, LayoutFingerprint, TieredKVStore
from ember_scheduler import EngineCore, RequestStatus, SamplingParams, SchedulerConfig

BLOCK, CHUNK = 4, 8
PARAMS = SamplingParams(max_tokens=6)


def _store() -> TieredKVStore:
    return TieredKVStore([CPUTier(10**7)], LayoutFingerprint("fake", "int64", BLOCK, 1, 1, 1,
                                                             chunk_size=CHUNK))  # fmt: skip


# Tests that take ``scheduling_mode`` run twice: steps one at a time, and async scheduling (step
# n+1 scheduled while step n runs), where the connector's per-step loads and saves must stay just
# as correct. The others check what each step does, as steps one at a time.
_MODE = {"async_scheduling": False}


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling_mode(request):
    _MODE["async_scheduling"] = request.param
    yield request.param
    _MODE["async_scheduling"] = False


def _engine(store, role="kv_both", load_delay_steps=0, **config):
    executor = FakeExecutor(64, BLOCK, kv_transfer_store=store, load_delay_steps=load_delay_steps)
    kv_transfer = KVTransferConfig.from_dict({
        "kv_connector": "TieredConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": [{"type": "cpu", "max_bytes": 1}]},
    })  # fmt: skip
    config.setdefault("max_model_len", 256)
    config.setdefault("async_scheduling", _MODE["async_scheduling"])
    return EngineCore(executor, SchedulerConfig(**config), kv_transfer_config=kv_transfer), executor


def _computed_tokens(executor, req_id) -> int:
    return sum(so.num_scheduled_tokens.get(req_id, 0) for so in executor.scheduler_outputs)


def _prompts(count, length=29, seed=0):
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(1, 97) for _ in range(length)] for i in range(count)}


def test_a_second_engine_loads_the_chunks_the_first_saved_and_computes_the_tail(scheduling_mode):
    store = _store()
    prompts = _prompts(3)
    first, _ = _engine(store, role="kv_producer")
    for rid, prompt in prompts.items():
        first.add_request(make_request(rid, prompt, PARAMS))
    run_to_completion(first)
    second, executor = _engine(store, role="kv_consumer")
    for rid, prompt in prompts.items():
        second.add_request(make_request(rid, prompt, PARAMS))
    results, stats = run_to_completion(second)
    for rid, prompt in prompts.items():
        assert results[rid].token_ids == reference_output(prompt, PARAMS, 256)[0]
        # 3 whole chunks of the 29-token prompt and the whole block of its partial chunk
        assert results[rid].num_cached_tokens == 28
        # Async scheduling runs a request stopped by its EOS one more step (that token is
        # dropped); max_tokens it sees coming.
        extra = int(scheduling_mode and len(results[rid].token_ids) < PARAMS.max_tokens)
        assert _computed_tokens(executor, rid) == 29 - 28 + len(results[rid].token_ids) - 1 + extra
    loaded = sum(s.kv_connector_stats.loaded_tokens for s in stats)
    assert loaded == 3 * 28
    assert second.kv_cache_manager.usage == 0.0


def _stored_prompt() -> tuple[TieredKVStore, list[int]]:
    """A store holding the chunks of a 29-token prompt, which another engine computed."""
    store = _store()
    prompt = _prompts(1)["r0"]
    warm, _ = _engine(store)
    warm.add_request(make_request("warm", prompt, PARAMS))
    run_to_completion(warm)
    return store, prompt


def test_a_loading_request_waits_without_blocking_others():
    store, prompt = _stored_prompt()
    engine, _ = _engine(store, load_delay_steps=3)
    engine.add_request(make_request("loads", prompt, PARAMS))
    engine.add_request(make_request("other", [5, 6, 7], PARAMS))
    [first_step] = engine.step().outputs
    assert engine.scheduler.requests["loads"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert first_step.request_id == "other"  # it ran while the other request waited
    results, _ = run_to_completion(engine)
    assert results["loads"].token_ids == reference_output(prompt, PARAMS, 256)[0]
    other = first_step.new_token_ids + results["other"].token_ids
    assert other == reference_output([5, 6, 7], PARAMS, 256)[0]
    assert results["loads"].num_cached_tokens == 28
    assert engine.kv_cache_manager.usage == 0.0


def test_a_chunk_gone_before_the_load_is_recomputed(scheduling_mode):
    store, prompt = _stored_prompt()
    engine, executor = _engine(store, load_delay_steps=1)
    engine.add_request(make_request("r", prompt, PARAMS))
    engine.step()  # found all 3 chunks; now the second disappears before the worker reads it
    store.evict(engine.scheduler.kv_transfer.connector._requests["r"].block_hashes[3])
    results, _ = run_to_completion(engine)
    assert results["r"].token_ids == reference_output(prompt, PARAMS, 256)[0]
    assert results["r"].num_cached_tokens == 8
    assert _computed_tokens(executor, "r") == 29 - 8 + len(results["r"].token_ids) - 1


def test_abort_while_loading_frees_the_blocks_once_the_load_ends(scheduling_mode):
    store, prompt = _stored_prompt()
    engine, _ = _engine(store, load_delay_steps=2)
    engine.add_request(make_request("r", prompt, PARAMS))
    engine.step()
    engine.abort_requests("r")
    assert engine.kv_cache_manager.usage > 0.0  # the worker may still be writing them
    run_to_completion(engine)
    assert engine.kv_cache_manager.usage == 0.0
    assert not engine.scheduler.kv_transfer.loading


def test_chunked_prefill_saves_every_chunk_once(scheduling_mode):
    store = _store()
    prompt = _prompts(1, length=45)["r0"]
    engine, executor = _engine(store, role="kv_producer", max_num_batched_tokens=10)
    engine.add_request(make_request("r", prompt, PARAMS))
    run_to_completion(engine)
    saved = [h for so in executor.scheduler_outputs for t in so.kv_connector_metadata.saves
             for h in t.chunk_hashes]  # fmt: skip
    # Every whole chunk computed, then the prompt's partial chunk (its 2 whole blocks of 3).
    assert len(saved) == len(set(saved)) == (45 + PARAMS.max_tokens - 1) // CHUNK + 1


def test_a_finished_request_holds_its_blocks_until_its_partial_chunk_is_saved():
    store = _store()
    prompt = _prompts(1)["r0"]
    engine, executor = _engine(store, role="kv_producer")
    free = engine.kv_cache_manager.num_free_blocks
    engine.add_request(make_request("r", prompt, SamplingParams(max_tokens=1)))
    [out] = engine.step().outputs
    assert out.finish_reason is not None
    assert engine.kv_cache_manager.num_free_blocks < free  # held: the save is not done yet
    assert engine.has_unfinished_requests()
    engine.abort_requests("r")  # already finished: nothing changes, the save still runs
    run_to_completion(engine)
    [save] = executor.scheduler_outputs[-1].kv_connector_metadata.saves
    assert (save.first_chunk, save.partial_blocks) == (3, 1)
    assert engine.kv_cache_manager.num_free_blocks == free
    assert not engine.scheduler.kv_transfer.saving


def test_abort_after_the_load_before_the_first_step_frees_the_blocks(scheduling_mode):
    store, prompt = _stored_prompt()
    engine, executor = _engine(store)
    engine.add_request(make_request("r", prompt, PARAMS))
    engine.step()  # the load is reported: the request waits, its loaded tokens computed
    request = engine.scheduler.requests["r"]
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 28
    engine.abort_requests("r")
    assert engine.kv_cache_manager.usage == 0.0
    engine.add_request(make_request("s", [5, 6, 7], PARAMS))
    run_to_completion(engine)
    assert executor.scheduler_outputs[1].kv_connector_metadata.discards == ["r"]
    assert engine.kv_cache_manager.usage == 0.0


def test_a_hasher_that_differs_from_the_store_keys_is_refused():
    # The chunks' keys are chain hashes: a scheduler hashing with another algorithm would never
    # find what the workers stored.
    with pytest.raises(ValueError, match="prefix_caching_hash_algo 'xxhash64' differs"):
        _engine(_store(), prefix_caching_hash_algo="xxhash64")


def test_connector_chunks_are_keyed_by_lora_adapter():
    """Chunks a producer saved for one adapter are not loaded for another adapter (nor for the
    base model); the same adapter loads them."""
    from ember_scheduler.lora import LoRAConfig, LoRARequest

    adapters = [LoRARequest(f"a{i}", i, f"/adapters/{i}") for i in (1, 2)]
    lora = LoRAConfig(max_loras=2)
    store = _store()
    prompt = _prompts(1)["r0"]
    first, _ = _engine(store, role="kv_producer", lora=lora)
    first.add_request(make_request("saved", prompt, PARAMS, lora_request=adapters[0]))
    run_to_completion(first)
    second, _ = _engine(store, role="kv_consumer", lora=lora)
    second.add_request(make_request("other", prompt, PARAMS, lora_request=adapters[1]))
    second.add_request(make_request("base", prompt, PARAMS))
    results, _ = run_to_completion(second)
    assert results["other"].num_cached_tokens == 0
    assert results["base"].num_cached_tokens == 0
    third, _ = _engine(store, role="kv_consumer", lora=lora)
    third.add_request(make_request("same", prompt, PARAMS, lora_request=adapters[0]))
    results, _ = run_to_completion(third)
    assert results["same"].num_cached_tokens == 28
