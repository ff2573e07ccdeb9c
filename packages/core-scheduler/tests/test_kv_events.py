"""The engine core reports its prefix-cache changes (KV events) so that a front end can mirror them."""

import random

import msgspec
from fake_executor import FakeExecutor, make_request

from ember_kv_cache import FullAttentionSpec, HybridKVCacheManager, SlidingWindowSpec
from ember_scheduler import EngineCore, SamplingParams, SchedulerConfig
from ember_scheduler.engine_types import (
    EngineCoreOutputs,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheCleared,
)


def _mirror(mirror: set[bytes], outputs: EngineCoreOutputs) -> None:
    # Through the wire, as the front end receives them.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    for event in wire.kv_events:
        if isinstance(event, KVBlocksStored):
            mirror.update(event.block_hashes)
        elif isinstance(event, KVBlocksRemoved):
            mirror.difference_update(event.block_hashes)
        else:
            assert isinstance(event, KVCacheCleared)
            mirror.clear()


def test_a_mirror_built_from_the_events_equals_the_prefix_cache_after_every_step():
    executor = FakeExecutor(24, 4)  # small: requests evict each other's cached blocks
    engine = EngineCore(executor, SchedulerConfig(max_model_len=128, enable_kv_events=True))
    cached = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    rng = random.Random(0)
    shared = [rng.randrange(1, 97) for _ in range(20)]
    mirror: set[bytes] = set()
    removed = 0
    for wave in range(6):
        for i in range(3):
            prompt = (shared if i == 0 else []) + [rng.randrange(1, 97) for _ in range(14)]
            engine.add_request(make_request(f"w{wave}-{i}", prompt, SamplingParams(max_tokens=6)))
        while engine.has_unfinished_requests():
            outputs = engine.step()
            removed += sum(len(e.block_hashes) for e in outputs.kv_events
                           if isinstance(e, KVBlocksRemoved))  # fmt: skip
            _mirror(mirror, outputs)
            assert mirror == set(cached)
    assert removed > 0  # the pool was small enough to evict
    assert engine.reset_prefix_cache()
    _mirror(mirror, engine.step())  # an idle step carries the reset
    assert mirror == set() == set(cached)


def test_no_events_unless_enabled():
    engine = EngineCore(FakeExecutor(24, 4), SchedulerConfig(max_model_len=128))
    engine.add_request(make_request("r", list(range(1, 30)), SamplingParams(max_tokens=4)))
    while engine.has_unfinished_requests():
        assert engine.step().kv_events == []


def test_events_of_each_layer_group_travel_apart():
    """A hybrid model's groups hash under seeds of their own: each event names its group."""
    specs = [FullAttentionSpec(), SlidingWindowSpec(4)]
    manager = HybridKVCacheManager(9, 4, specs, enable_kv_events=True)
    engine = EngineCore(FakeExecutor(24, 4), SchedulerConfig(max_model_len=128))
    engine.kv_cache_manager = manager  # the engine core turns the manager's events into its own
    first, second = list(range(8)), list(range(50, 66))
    manager.allocate_slots("a", first, 8)
    manager.free("a")
    manager.allocate_slots("b", second, 16)  # 8 blocks: evicts the four cached ones
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(engine.step()), type=EngineCoreOutputs)
    stored = {0: [], 1: []}
    removed = {0: [], 1: []}
    for event in wire.kv_events:
        (stored if isinstance(event, KVBlocksStored) else removed)[event.group] += (
            event.block_hashes
        )
    for group in (0, 1):
        hasher = manager.groups[group].hasher
        assert sorted(removed[group]) == sorted(hasher.hash_prefix(first))
        assert stored[group] == hasher.hash_prefix(first) + hasher.hash_prefix(second)
