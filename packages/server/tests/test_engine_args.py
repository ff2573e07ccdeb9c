import argparse

import pytest

from ember_server.engine.engine_args import DEFAULT_ASYNC_SCHEDULING, EngineArgs, parse_bytes


def test_cli_round_trip_sets_every_field():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    namespace = parser.parse_args(
        [
            "--model", "/m", "--tokenizer", "/t", "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--block-size", "32",
            "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching",
            "--served-model-name", "tiny", "--seed", "7", "--scheduling-policy", "priority",
            "--num-threads", "3", "-tp", "2", "--pipeline-parallel-size", "3",
            "--enable-expert-parallel",
            "--distributed-executor-backend", "ray", "--no-async-scheduling",
            "--gpu-memory-utilization", "0.5", "--prefix-caching-hash-algo", "xxhash64",
        ]
    )  # fmt: skip
    args = EngineArgs.from_cli_args(namespace)
    assert args == EngineArgs(
        model="/m",
        tokenizer="/t",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        block_size=32,
        kv_cache_memory=64 * 1024**2,
        enable_prefix_caching=False,
        served_model_name="tiny",
        seed=7,
        scheduling_policy="priority",
        num_threads=3,
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        enable_expert_parallel=True,
        distributed_executor_backend="ray",
        async_scheduling=False,
        gpu_memory_utilization=0.5,
        prefix_caching_hash_algo="xxhash64",
    )
    assert args.model_name == "tiny"
    assert not args.use_async_scheduling


def test_async_scheduling_default_composes_with_every_setting():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", "/m"])).async_scheduling is None
    on = parser.parse_args(["--model", "/m", "--async-scheduling"])
    assert EngineArgs.from_cli_args(on).use_async_scheduling
    assert EngineArgs(model="/m").use_async_scheduling == DEFAULT_ASYNC_SCHEDULING
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    # Speculative decoding composes with it: its default stands, and it may be asked for.
    with_spec = EngineArgs(model="/m", speculative_config=spec)
    assert with_spec.use_async_scheduling == DEFAULT_ASYNC_SCHEDULING
    assert EngineArgs(
        model="/m", speculative_config=spec, async_scheduling=True
    ).use_async_scheduling
    tiers = {"kv_connector": "TieredConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"tiers": [{"type": "cpu", "max_bytes": 1 << 20}]}}  # fmt: skip
    # A KV connector composes with it (tests/test_kv_connectors.py checks the tokens).
    with_connector = EngineArgs(model="/m", kv_transfer_config=tiers)
    assert with_connector.use_async_scheduling == DEFAULT_ASYNC_SCHEDULING
    assert EngineArgs(model="/m", kv_transfer_config=tiers, async_scheduling=True).async_scheduling
    with pytest.raises(ValueError, match=r"EngineArgs\.async_scheduling"):
        EngineArgs(model="/m", async_scheduling="yes")


def test_defaults_derive_from_model():
    args = EngineArgs.from_cli_args(
        EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "/m"])
    )
    assert args.enable_prefix_caching is True
    assert args.model_name == "/m"
    assert args.max_model_len is None and args.kv_cache_memory is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("block_size", -1),
        ("max_model_len", 0),
        ("dtype", "int8"),
        ("model", ""),
        ("num_threads", 0),
        ("tensor_parallel_size", 0),
        ("pipeline_parallel_size", "2"),
        ("enable_expert_parallel", "yes"),
        ("expert_placement_strategy", "random"),
        ("distributed_executor_backend", "threads"),
        ("prefix_caching_hash_algo", "md5"),
        ("scheduling_policy", "lifo"),
    ],
)
def test_bad_values_name_the_field(field, value):
    kwargs = {"model": "/m", field: value}
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


def test_parse_bytes_units():
    assert parse_bytes("1048576") == 1048576
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("1.5k") == 1500
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes("lots")


def test_speculative_config_from_the_command_line():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--model", "/m", "--speculative-config", flag])
    )
    assert args.speculative_config.method == "ngram"
    assert args.speculative_config.num_speculative_tokens == 4
    assert args.speculative_config.prompt_lookup_min == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/m", "--speculative-config", "{not json"])


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ],
)
def test_bad_speculative_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        EngineArgs(model="/m", speculative_config=config)


def test_one_settings_object_per_side_both_sides_get_the_shared_settings(tiny_model):
    """EngineArgs becomes the scheduler's and the worker's configs in one place: the settings
    both read (the prefix-cache hash that also keys KV tier chunks, the limits) agree."""
    from ember_server.engine.engine_factory import make_scheduler_config, make_worker_config
    from ember_server.engine.model_config import ModelConfig

    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=3,
        block_size=8,
        prefix_caching_hash_algo="xxhash128",
        gpu_memory_utilization=0.25,
    )
    model_config = ModelConfig.from_engine_args(args)
    worker = make_worker_config(args, model_config, 1 << 20, served=False)
    scheduler = make_scheduler_config(args, model_config)
    assert worker.prefix_caching_hash_algo == scheduler.prefix_caching_hash_algo == "xxhash128"
    assert worker.gpu_memory_utilization == 0.25
    assert (worker.max_num_seqs, worker.block_size, worker.max_model_len) == (3, 8, 64)
    assert scheduler.max_num_seqs == 3 and scheduler.max_model_len == 64
    # Left unset, the worker keeps its own (the only) default.
    unset = make_worker_config(
        EngineArgs(model=args.model, dtype="float32"), model_config, None, served=False
    )
    assert unset.gpu_memory_utilization == 0.9
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_worker_config(
            EngineArgs(model=args.model, dtype="float32", gpu_memory_utilization=1.5), model_config, None,
            served=False,
        )  # fmt: skip


def test_data_parallel_attention_with_expert_parallel_runs_on_worker_processes_in_lock_step():
    args = EngineArgs(model="/m", data_parallel_size=2, enable_expert_parallel=True)
    assert not args.use_async_scheduling  # one step per lock-step pass
    for field, value in (
        ("distributed_executor_backend", "ray"),
        ("distributed_executor_backend", "uni"),
        ("pipeline_parallel_size", 2),
        ("async_scheduling", True),
    ):
        with pytest.raises(ValueError, match=f"EngineArgs.{field}"):
            EngineArgs(
                model="/m", data_parallel_size=2, enable_expert_parallel=True, **{field: value}
            )
    EngineArgs(model="/m", data_parallel_size=2, async_scheduling=True)  # independent engines
    EngineArgs(model="/m", tensor_parallel_size=2, enable_expert_parallel=True)


def test_each_lock_step_engine_core_gets_its_place_in_the_worker_config(tiny_model):
    """The launcher's places (one rendezvous for the engine cores, one for their workers) become
    each engine's ``ParallelConfig``: the one owner of the data-parallel rank."""
    from ember_server.engine.engine_factory import make_worker_config
    from ember_server.engine.lockstep import data_parallel_places
    from ember_server.engine.model_config import ModelConfig

    args = EngineArgs(
        model=str(tiny_model("mixtral")), dtype="float32", data_parallel_size=2,
        enable_expert_parallel=True,
    )  # fmt: skip
    model_config = ModelConfig.from_engine_args(args)
    places = data_parallel_places(2)
    assert [p.rank for p in places] == [0, 1]
    assert len({places[0].engines_init_method, places[0].workers_init_method}) == 2
    for place in places:
        parallel = make_worker_config(args, model_config, 1 << 20, served=False, place=place)
        parallel = parallel.parallel
        assert (parallel.data_parallel_size, parallel.data_parallel_rank) == (2, place.rank)
        assert parallel.data_parallel_init_method == place.workers_init_method
        assert parallel.spans_data_parallel and parallel.world_size == 1
    with pytest.raises(ValueError, match="data_parallel_size"):  # only the launcher starts them
        make_worker_config(args, model_config, 1 << 20, served=False)
    independent = EngineArgs(model=args.model, dtype="float32", data_parallel_size=2)
    parallel = make_worker_config(independent, model_config, 1 << 20, served=False).parallel
    assert parallel.data_parallel_size == 1 and not parallel.spans_data_parallel
