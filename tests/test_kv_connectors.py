"""KV connectors end to end: tier hits across engine processes, prefill/decode disaggregation,
and faults (damaged, truncated and foreign entries, Redis killed mid-run, a full disk tier).

Greedy outputs with the connector must equal those of an engine without it, token for token;
what the connector saved the engine from computing shows in ``num_cached_tokens`` and metrics.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest

from ember_kv_cache import BlockHasher, LayoutFingerprint
from ember_kv_cache.tier_entry import encode_entry
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.llm import LLM

CHUNK = 64
BLOCK = 16  # the engine's default block size
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
KV_MEMORY = 1 << 23


def transfer_config(role: str, *tiers: dict) -> dict:
    return {
        "kv_connector": "TieredConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": list(tiers)},
    }


def disk(path, max_bytes=1 << 30) -> dict:
    return {"type": "disk", "path": str(path), "max_bytes": max_bytes}


def prompt(length: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1800 for i in range(length)]


def run(llm: LLM, token_ids: list[int]):
    [output] = llm.generate({"prompt_token_ids": token_ids}, GREEDY, use_tqdm=False)
    return output.outputs[0].token_ids, output.num_cached_tokens


def metric(llm: LLM, name: str, tier: str | None = None) -> float:
    labels = {"model_name": llm.model_config.served_model_name}
    if tier is not None:
        labels["tier"] = tier
    return llm.metrics.registry.get_sample_value(name + "_total", labels) or 0.0


_ENGINE_SCRIPT = """
import json, sys
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.llm import LLM
model, config, token_ids = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
settings = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
sampling = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
llm = LLM(model, kv_transfer_config=config, kv_cache_memory=1 << 23, **{"dtype": "float32", **settings})
[out] = llm.generate({"prompt_token_ids": token_ids},
                     SamplingParams(max_tokens=8, temperature=0.0, **sampling), use_tqdm=False)
registry, name = llm.metrics.registry, llm.model_config.served_model_name
tier = config["kv_connector_extra_config"]["tiers"][-1]["type"]
print(json.dumps({
    "tokens": out.outputs[0].token_ids,
    "cached": out.num_cached_tokens,
    "loaded": registry.get_sample_value("ember:kv_connector_loaded_tokens_total",
                                        {"model_name": name}),
    "tier_hits": registry.get_sample_value("ember:kv_tier_hits_total",
                                           {"model_name": name, "tier": tier}),
    "prompt_tokens": registry.get_sample_value("ember:prompt_tokens_total", {"model_name": name}),
}))
llm.engine_core.shutdown()
"""


def _engine_process(model, config, token_ids, sampling=None, **settings) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _ENGINE_SCRIPT, str(model), json.dumps(config),
         json.dumps(token_ids), json.dumps(settings), json.dumps(sampling or {})],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_fresh_engine_process_loads_a_long_prompt_another_served(
    tier, tiny_model, tmp_path, request
):
    model = tiny_model("llama")
    if tier == "disk":
        shared = disk(tmp_path / "kv")
    else:
        _, url = request.getfixturevalue("redis_server")
        shared = {"type": "redis", "url": url}
    config = transfer_config("kv_both", {"type": "cpu", "max_bytes": 1 << 26}, shared)
    token_ids = prompt(900)
    first = LLM(str(model), dtype="float32", kv_transfer_config=config, kv_cache_memory=KV_MEMORY)
    tokens, cached = run(first, token_ids)
    assert cached == 0 and metric(first, "ember:kv_connector_loaded_tokens") == 0
    first.engine_core.shutdown()
    second = _engine_process(model, config, token_ids)
    matched = (900 - 1) // CHUNK * CHUNK  # every whole chunk but the one holding the last token
    assert second["tokens"] == tokens
    assert second["cached"] == second["loaded"] == matched
    assert second["tier_hits"] == matched // CHUNK  # from the shared tier (the CPU one is new)
    assert second["prompt_tokens"] == 900  # the front end counts the prompt either way


def test_tensor_parallel_ranks_each_store_and_load_their_shard(tiny_model, tmp_path):
    model = tiny_model("llama")
    config = transfer_config("kv_both", disk(tmp_path / "kv"))
    token_ids = prompt(300, seed=5)
    plain = LLM(str(model), dtype="float32", kv_cache_memory=KV_MEMORY)
    expected, _ = run(plain, token_ids)
    plain.engine_core.shutdown()
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    first = _engine_process(model, config, token_ids, **tp2)
    assert first["tokens"] == expected and first["cached"] == 0
    # Two ranks, two fingerprints: every chunk and the partial one is stored once per rank.
    entries = sorted(path.name.split("-")[0] for path in (tmp_path / "kv").glob("*.kv"))
    assert len(set(entries)) == 2 and len(entries) % 2 == 0
    second = _engine_process(model, config, token_ids, **tp2)
    assert second["tokens"] == expected
    assert second["cached"] == second["loaded"] == (300 - 1) // BLOCK * BLOCK  # chunks + partial
    # One rank's copy of the second chunk damaged: every rank computes from that chunk on.
    second_chunk = BlockHasher(BLOCK).hash_prefix(token_ids)[2 * CHUNK // BLOCK - 1]
    file = tmp_path / "kv" / f"{entries[0]}-{second_chunk.hex()}.kv"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))
    third = _engine_process(model, config, token_ids, **tp2)
    assert third["tokens"] == expected
    assert third["cached"] == CHUNK


def _transformers_greedy(model, token_ids: list[int], num_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # plain argmax, as the engine's ignore_eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([token_ids]), max_new_tokens=num_tokens, do_sample=False)
    return out[0, len(token_ids) :].tolist()


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"pipeline_parallel_size": 2}, id="pp2-mp"),
        pytest.param({"async_scheduling": True}, id="async"),
        pytest.param(
            {"pipeline_parallel_size": 2, "async_scheduling": True},
            id="pp2-mp-async",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
            id="tp2-ray",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
            id="pp2-ray",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_greedy_matches_transformers_and_a_second_engine_loads_every_rank_shard(
    settings, tiny_model, tmp_path
):
    """Every rank (a pipeline stage, a tensor-parallel shard) stores and loads its own shard of
    the KV; a second engine loads them all, and its tokens are transformers' token for token."""
    model = tiny_model("qwen2")
    config = transfer_config("kv_both", disk(tmp_path / "kv"))
    token_ids = prompt(300, seed=6)
    expected = _transformers_greedy(model, token_ids, GREEDY.max_tokens)
    ignore_eos = {"ignore_eos": True}
    first = _engine_process(model, config, token_ids, ignore_eos, **settings)
    assert first["tokens"] == expected and first["cached"] == 0
    ranks = settings.get("pipeline_parallel_size", 1) * settings.get("tensor_parallel_size", 1)
    entries = sorted(path.name.split("-")[0] for path in (tmp_path / "kv").glob("*.kv"))
    assert len(set(entries)) == ranks and len(entries) % ranks == 0  # one fingerprint per rank
    second = _engine_process(model, config, token_ids, ignore_eos, **settings)
    assert second["tokens"] == expected
    # Every whole chunk, and the whole blocks of the partial one, from the tier.
    assert second["cached"] == second["loaded"] == (300 - 1) // BLOCK * BLOCK


# deepseek_v2: the MLA latent cache (one tensor per layer) travels through the same chunks.
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "deepseek_v2"])
def test_prefill_decode_disaggregation_matches_a_single_instance(arch, tiny_model, tmp_path):
    model = str(tiny_model(arch))
    shared = disk(tmp_path / "kv")
    token_ids = prompt(300, seed=1)
    single = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY)
    expected, _ = run(single, token_ids)
    producer = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY,
                   kv_transfer_config=transfer_config("kv_producer", shared))  # fmt: skip
    [prefill] = producer.generate(
        {"prompt_token_ids": token_ids},
        SamplingParams(max_tokens=1, temperature=0.0),
        use_tqdm=False,
    )
    assert prefill.outputs[0].token_ids == expected[:1]
    # The stored chunks have the layout's shape: MLA's latent once, not as key and value.
    store = producer.engine_core.executor.kv_transfer_store
    first_chunk = producer.engine_core.kv_cache_manager.hasher.hash_prefix(token_ids)[
        CHUNK // BLOCK - 1
    ]
    layout = store.fingerprint
    assert layout.tensors_per_layer == (1 if arch == "deepseek_v2" else 2)
    assert store.get(first_chunk).shape == layout.chunk_shape()
    consumer = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY,
                   kv_transfer_config=transfer_config("kv_consumer", shared))  # fmt: skip
    tokens, cached = run(consumer, token_ids)
    assert tokens == expected
    # The decode instance computes only the prompt's last, partial block: the whole chunks and
    # the partial chunk's whole blocks (saved when the prefill request finished) are loaded.
    assert cached == 300 // BLOCK * BLOCK == 288
    assert metric(consumer, "ember:kv_connector_loaded_tokens") == 288


def _stored_entries(path):
    return sorted(path.glob("*.kv"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_entry_is_recomputed_never_used(damage, tiny_model, tmp_path, caplog):
    model = str(tiny_model("qwen2"))
    shared = disk(tmp_path / "kv")
    token_ids = prompt(200, seed=2)
    producer = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY,
                   kv_transfer_config=transfer_config("kv_producer", shared))  # fmt: skip
    expected, _ = run(producer, token_ids)
    # Damage the prompt's second chunk (entries are named fingerprint-hash; find it by content).
    consumer = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY,
                   kv_transfer_config=transfer_config("kv_consumer", shared))  # fmt: skip
    store = consumer.engine_core.executor.kv_transfer_store
    hasher = consumer.engine_core.kv_cache_manager.hasher
    second_chunk = hasher.hash_prefix(token_ids)[2 * CHUNK // hasher.block_size - 1]
    file = tmp_path / "kv" / (store.fingerprint.tier_key(second_chunk) + ".kv")
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        other = LayoutFingerprint("another-model", "float32", 16, 2, 2, 16, chunk_size=CHUNK)
        data = encode_entry(other, second_chunk, b"\0" * 1000)
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ember_kv_cache.tier_store"):
        tokens, cached = run(consumer, token_ids)
    assert tokens == expected
    assert cached == CHUNK  # the first chunk loaded; from the damaged one on, computed
    assert metric(consumer, "ember:kv_tier_invalid_entries", "disk") == 1
    assert "dropping entry" in caplog.text


def test_redis_killed_mid_run_falls_back_to_recompute(tiny_model, redis_server, caplog):
    process, url = redis_server
    model = str(tiny_model("llama"))
    shared = {"type": "redis", "url": url}
    warm = LLM(
        model,
        dtype="float32",
        kv_cache_memory=KV_MEMORY,
        kv_transfer_config=transfer_config("kv_both", shared),
    )
    first, second = prompt(200, seed=3), prompt(200, seed=4)
    expected = [run(warm, first)[0], run(warm, second)[0]]
    engine = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY,
                 kv_transfer_config=transfer_config("kv_both", shared))  # fmt: skip
    assert run(engine, first) == (expected[0], 192)  # from Redis
    process.kill()
    process.wait()
    with caplog.at_level(logging.WARNING, logger="ember_kv_cache.tier_store"):
        assert run(engine, second) == (expected[1], 0)  # recomputed, no request failed
        assert run(engine, first)[0] == expected[0]  # the local prefix cache still serves it
    assert "redis tier unavailable" in caplog.text
    assert metric(engine, "ember:kv_tier_errors", "redis") >= 1


def test_a_disk_tier_over_its_limit_stays_under_it(tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    limit = 300_000
    engine = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY,
                 kv_transfer_config=transfer_config("kv_both", disk(tmp_path, limit)))  # fmt: skip
    reference = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY)
    for seed in range(6):
        token_ids = prompt(260, seed=10 + seed)
        assert run(engine, token_ids)[0] == run(reference, token_ids)[0]
        assert sum(f.stat().st_size for f in _stored_entries(tmp_path)) <= limit
    assert len(_stored_entries(tmp_path)) < 6 * 4  # older chunks were evicted


def test_each_layer_reads_the_cache_only_after_its_load_is_written(
    tiny_model, tmp_path, monkeypatch
):
    """Loaded chunks are written layer by layer during the forward that first reads them; a
    slow writer shows that every attention layer waits for its own layer's write."""
    from ember_worker.kv_connector import TieredConnectorWorker
    from ember_worker.layers import attention

    model = str(tiny_model("llama"))
    token_ids = prompt(300, seed=2)
    config = transfer_config("kv_both", disk(tmp_path / "kv"))
    expected, _ = run(
        LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY, kv_transfer_config=config), token_ids
    )

    events: list[tuple] = []
    layer_of: dict[int, int] = {}
    write_layer, start_load_kv = (
        TieredConnectorWorker._write_layer,
        TieredConnectorWorker.start_load_kv,
    )
    paged_attention = attention.ek.paged_attention

    def slow_write_layer(self, chunks, layer):
        time.sleep(0.05)
        write_layer(self, chunks, layer)
        events.append(("written", layer))

    def noting_start_load_kv(self):
        layer_of.update({key.data_ptr(): i for i, (key, _) in enumerate(self.kv_caches)})
        start_load_kv(self)
        if self._layer_writes:
            events.append(("queued",))

    def noting_paged_attention(q, key_cache, *args, **kwargs):
        events.append(("read", layer_of.get(key_cache.data_ptr())))
        return paged_attention(q, key_cache, *args, **kwargs)

    monkeypatch.setattr(TieredConnectorWorker, "_write_layer", slow_write_layer)
    monkeypatch.setattr(TieredConnectorWorker, "start_load_kv", noting_start_load_kv)
    monkeypatch.setattr(attention.ek, "paged_attention", noting_paged_attention)
    fresh = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY, kv_transfer_config=config)
    num_layers = len(fresh.engine_core.executor.model_runner.kv_caches)
    tokens, cached = run(fresh, token_ids)
    assert tokens == expected and cached == 288
    assert events.count(("queued",)) == 1
    step = events[events.index(("queued",)) :]
    for layer in range(num_layers):
        assert step.index(("written", layer)) < step.index(("read", layer))


def test_a_finished_request_saves_its_partial_chunk_then_frees_its_blocks(tiny_model, tmp_path):
    model = str(tiny_model("qwen2"))
    config = transfer_config("kv_both", disk(tmp_path / "kv"))
    token_ids = prompt(300, seed=3)
    first = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY, kv_transfer_config=config)
    kv = first.engine_core.kv_cache_manager
    free_before = kv.num_free_blocks
    tokens, _ = run(first, token_ids)
    assert kv.num_free_blocks == free_before  # held for the save, freed once it was reported
    first.engine_core.shutdown()
    fresh = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY, kv_transfer_config=config)
    again, cached = run(fresh, token_ids)
    assert again == tokens and cached == 288  # 4 chunks and 2 of the partial chunk's 2 blocks
    fresh.engine_core.shutdown()
    another = LLM(model, dtype="float32", kv_cache_memory=KV_MEMORY, kv_transfer_config=config)
    _, cached = run(another, token_ids + prompt(40, seed=5))
    assert cached == 288  # a longer prompt finds the same partial key
