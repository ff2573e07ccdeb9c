"""The Ray executor: one Ray actor per rank, placed by a placement group across a Ray cluster.

Joins the running cluster (``RAY_ADDRESS``, or one started with ``ray start`` on this machine) or
starts a local one. A placement group reserves one bundle per rank (a GPU each, or a CPU), packed
so that a stage's tensor-parallel ranks share a machine when they fit; rank 0's machine hosts the
``torch.distributed`` rendezvous. Each step's ``SchedulerOutput`` is msgpack-encoded once and put
in Ray's object store once; every actor reads that one object. The output rank returns the
``ModelRunnerOutput`` msgpack-encoded (with a KV connector every rank does, and their connector
reports are combined); a rank that raises or dies fails the step naming the rank.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, wait

import msgspec
import torch

from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_worker.distributed.grammar_proxy import RankGrammarCompiler, compile_report
from ember_worker.distributed.groups import free_port, init_rank_groups
from ember_worker.distributed.worker import (
    RankAnswers,
    Worker,
    WorkerConfig,
    WorkerFailedError,
    backend_for,
    model_vocab_size,
    rank_device,
    scheduler_side_store,
)
from ember_worker.kv_specs import model_layer_kv_specs

_STOP_GRACE_S = 5.0
_GRAMMAR_GROUP = "grammar"  # actor threads that compile grammars beside the step thread


class RayWorker:
    """One rank inside a Ray actor (``ray.remote`` is applied when the executor starts)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._encoder = msgspec.msgpack.Encoder()

    def rendezvous_address(self) -> str:
        """A ``tcp://`` address on this actor's machine for the ``torch.distributed`` rendezvous."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('0.0.0.0')}"

    def start(
        self, config: bytes, rank: int, init_method: str, device: str | None
    ) -> tuple[int, dict | None]:
        """Join the world, load this rank's part of the model; returns its KV block capacity
        and, with a KV connector, its layout fingerprint's fields."""
        worker_config = msgspec.json.decode(config, type=WorkerConfig)
        rank_dev = rank_device(rank, device)
        groups = init_rank_groups(worker_config.parallel, rank, init_method, backend_for(rank_dev))
        self.worker = Worker(worker_config, groups, rank_dev)
        return self.worker.num_available_blocks(), self.worker.kv_fingerprint_fields()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: bytes) -> bytes | None:
        output = self.worker.execute_model(self._decoder.decode(scheduler_output))
        return None if output is None else self._encoder.encode(output)

    def compile_grammar(self, key: bytes) -> str | None:
        """Compile the structured-output spec ``key`` (its msgpack bytes) as this rank's
        matchers will use it; returns None, or why it does not compile. Runs in the actor's
        grammar concurrency group, beside its steps."""
        if self.worker.grammar_compiler is None:  # a stage before the last samples nothing
            return None
        spec = msgspec.msgpack.decode(key, type=StructuredOutputsParams)
        future = self.worker.grammar_compiler.compile(spec)
        wait([future])
        return compile_report(future)

    def shutdown(self) -> None:
        """Stop the KV connector's transfers and the grammar compiler before the actor goes."""
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor:
    """Implements the engine core's ``Executor`` with one Ray actor per rank."""

    def __init__(
        self, config: WorkerConfig, device: str | None = None, startup_timeout: float = 600.0
    ) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as error:
            raise ImportError(
                "distributed_executor_backend='ray' needs Ray: pip install 'ember-worker[ray]'"
            ) from error
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()
        self.config = config
        self.block_size = config.block_size
        self.step_threads = None  # the ranks set their own threads, in their processes
        self.kv_transfer_store = None  # the scheduler side's lookups, with a KV connector
        parallel = config.parallel
        self._answers = RankAnswers(config)
        self._decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._encoder = msgspec.msgpack.Encoder()
        self.actors: list = []
        self._placement_group = None
        self.vocab_size = model_vocab_size(config.model)
        self.kv_cache_specs = model_layer_kv_specs(config.model)
        # Compiled by the ranks that sample; the output rank's answer resolves the future.
        self.grammar_compiler = RankGrammarCompiler(self._send_compile)
        uses_gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        resources = dict(num_gpus=1, num_cpus=0) if uses_gpu else dict(num_cpus=1)
        bundle = {"GPU": 1} if uses_gpu else {"CPU": 1}
        try:
            self._placement_group = placement_group([bundle] * parallel.world_size, "PACK")
            ready, _ = ray.wait([self._placement_group.ready()], timeout=startup_timeout)
            if not ready:
                raise WorkerFailedError(
                    f"Ray could not place {parallel.world_size} workers of {bundle} within "
                    f"{startup_timeout:.0f} s; the cluster has {ray.cluster_resources()}"
                )
            actor_class = ray.remote(concurrency_groups={_GRAMMAR_GROUP: 2})(RayWorker)
            for rank in range(parallel.world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank
                )
                self.actors.append(
                    actor_class.options(scheduling_strategy=strategy, **resources).remote()
                )
            init_method = ray.get(self.actors[0].rendezvous_address.remote())
            payload = msgspec.json.encode(config)
            reports = self._gather(
                [
                    a.start.remote(payload, r, init_method, device)
                    for r, a in enumerate(self.actors)
                ],
                "at start-up",
            )
            # Every rank allocates the block count that fits the smallest budget.
            self.num_kv_blocks = min(blocks for blocks, _ in reports)
            self.kv_transfer_store = scheduler_side_store(config, reports[0][1])
            self._gather(
                [a.initialize_kv_cache.remote(self.num_kv_blocks) for a in self.actors],
                "at start-up",
            )
        except BaseException:
            self.shutdown()
            raise

    def _send_compile(self, key: bytes) -> None:
        if not self.actors:
            return
        refs = [
            actor.compile_grammar.options(concurrency_group=_GRAMMAR_GROUP).remote(key)
            for actor in self.actors
        ]
        answer = refs[self.config.parallel.output_rank].future()
        answer.add_done_callback(lambda done: self._resolve_compile(key, done))

    def _resolve_compile(self, key: bytes, answer: Future) -> None:
        error = answer.exception()
        if error is not None:  # the rank died or raised: the step that follows names it
            self.grammar_compiler.resolve(key, f"the grammar could not be compiled: {error}")
        else:
            self.grammar_compiler.resolve(key, answer.result())

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | RayStepOutput:
        """Run a step on every actor (each runs its steps in the order submitted); with
        ``non_block`` return at once (``RayStepOutput.result()`` waits for the output)."""
        if not self.actors:
            raise WorkerFailedError("the executor's workers have failed or been shut down")
        shared = self._ray.put(self._encoder.encode(scheduler_output))
        refs = [a.execute_model.remote(shared) for a in self.actors]
        step = RayStepOutput(self, refs)
        return step if non_block else step.result()

    def _output_of(self, refs: list) -> ModelRunnerOutput:
        results = self._gather(refs, "in a step")
        return self._answers.merge([self._decoder.decode(results[r]) for r in self._answers.ranks])

    def _gather(self, refs: list, when: str) -> list:
        """Every rank's result in rank order; the first rank to fail raises, naming the rank."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[done[0]]] = ray.get(done[0])
            except Exception as error:
                raise WorkerFailedError(
                    f"worker rank {rank_of[done[0]]} failed {when}: {error}"
                ) from error
        return results

    def shutdown(self) -> None:
        """Kill the actors, release the placement group, and stop Ray if this executor began it."""
        ray = self._ray
        if self.actors:
            # Let each rank's KV connector finish its transfers; a dead rank is killed anyway.
            with contextlib.suppress(Exception):
                ray.get([a.shutdown.remote() for a in self.actors], timeout=_STOP_GRACE_S)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None
        self.grammar_compiler.shutdown()
        if self.kv_transfer_store is not None:
            self.kv_transfer_store.close()
            self.kv_transfer_store = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


class RayStepOutput:
    """A step submitted to the actors; ``result()`` waits for every rank and decodes the
    output rank's result."""

    __slots__ = ("_executor", "_refs")

    def __init__(self, executor: RayExecutor, refs: list) -> None:
        self._executor = executor
        self._refs = refs

    def result(self) -> ModelRunnerOutput:
        return self._executor._output_of(self._refs)
