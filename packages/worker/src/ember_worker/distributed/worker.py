"""One rank's worker: its shard of the model, its share of the KV cache, its model runner, its KV
connector and its grammar matchers.

``Worker`` is the only rank implementation: the in-process executor runs one in the engine
core's process (with the step thread), the multiprocess and Ray executors one per rank elsewhere,
all built from the same ``WorkerConfig``. Start-up is in two steps because the ranks must agree
on the KV block count: each reports how many blocks its budget holds, then all allocate the
smallest.
"""

from __future__ import annotations

import dataclasses

import msgspec
import torch

import ember_kernels as ek
from ember_kv_cache import (
    DEFAULT_HASH_ALGO,
    HASH_ALGOS,
    KVTransferConfig,
    LayoutFingerprint,
    TieredKVStore,
)
from ember_kv_cache.rank_outputs import RankOutputCombiner
from ember_scheduler.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    check_int,
)
from ember_scheduler.lora import LoRAConfig
from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_spec_decode import SpeculativeConfig
from ember_worker.distributed.groups import ParallelConfig, RankGroups, single_rank_groups
from ember_worker.expert_load import ExpertLoadStats, check_log_interval
from ember_worker.hf_config import load_hf_config, resolve_model_path
from ember_worker.host_memory import retain_freed_host_memory
from ember_worker.kv_cache import kv_cache_budget
from ember_worker.kv_connector import TieredConnectorWorker, layout_fingerprint
from ember_worker.model_loader import load_model
from ember_worker.model_runner import ModelRunner
from ember_worker.models import DecoderConfig
from ember_worker.models.moe import idle_expert_pass
from ember_worker.quantization import check_quantization
from ember_worker.step_threads import LARGE_STEP_MIN_TOKENS, StepThreads
from ember_worker.structured_outputs import XGrammarCompiler


class WorkerConfig(msgspec.Struct, frozen=True):
    """Everything a rank needs to load its part of the model; the same for every rank.

    ``kv_cache_memory`` is each rank's budget in bytes (required on the CPU; on a GPU,
    ``gpu_memory_utilization`` of the memory left free by the model when it is None).
    ``num_threads`` sets each rank's torch intra-op threads for steps of at least
    ``large_step_min_tokens`` scheduled tokens, ``small_num_threads`` (default: the same) for
    smaller ones (``StepThreads``); None leaves them alone. ``kv_transfer`` is vLLM's
    ``kv_transfer_config`` dict: each rank then moves its own shard of the KV chunks, keyed with
    its layout fingerprint and ``prefix_caching_hash_algo``'s chain hashes (the scheduler's).
    ``speculative_config`` makes the runner verify drafts (and load the draft model).
    """

    model: str
    tokenizer: str | None = None  # for structured outputs' grammars; None: the model's folder
    dtype: str = "auto"
    quantization: str | None = None  # ember_worker.quantization.QUANTIZATION_METHODS
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    num_threads: int | None = None
    small_num_threads: int | None = None
    large_step_min_tokens: int = LARGE_STEP_MIN_TOKENS
    parallel: ParallelConfig = ParallelConfig()
    kv_transfer: dict | None = None
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    speculative_config: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # set: requests may run with LoRA adapters
    # Log the MoE layers' per-expert load every this many steps (``ExpertLoadStats``); 0: never.
    expert_load_log_interval: int = 0

    def __post_init__(self) -> None:
        check_quantization(self.quantization, "WorkerConfig.quantization")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            check_int(name, getattr(self, name))
        check_int("kv_cache_memory", self.kv_cache_memory, optional=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.num_threads is not None:
            StepThreads(self.num_threads, self.small_num_threads, self.large_step_min_tokens)
        if self.kv_transfer is not None:
            KVTransferConfig.from_dict(self.kv_transfer)
        check_log_interval(self.expert_load_log_interval)

    def step_threads(self) -> StepThreads | None:
        """A fresh ``StepThreads`` of these counts (None when ``num_threads`` is None)."""
        if self.num_threads is None:
            return None
        return StepThreads(self.num_threads, self.small_num_threads, self.large_step_min_tokens)


class WorkerFailedError(RuntimeError):
    """A worker rank raised, exited or could not start; the message names the rank."""


class Worker:
    """One rank: loads its part of the model, then ``initialize_kv_cache`` and ``execute_model``.

    ``groups`` (default: a single rank) are its tensor-parallel group and pipeline stage;
    ``device`` defaults to the GPU when there is one. ``step_threads`` holds the thread counts
    its steps run with (changeable between steps, in this process); ``grammar_compiler``
    compiles the structured-output grammars its matchers use (None on a pipeline stage before
    the last: it samples nothing).
    """

    def __init__(
        self,
        config: WorkerConfig,
        groups: RankGroups | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        groups = single_rank_groups() if groups is None else groups
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.config = config
        self.device = torch.device(device)
        self.tp_rank = groups.tp.rank
        self.step_threads = config.step_threads()
        if self.step_threads is not None:
            # torch's intra-op threads are process-wide; loading and warm-up take the large count.
            torch.set_num_threads(self.step_threads.large)
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            # Load the compiled kernels now, before the weights, whose layout may follow them; a
            # first build on this CPU runs in the background while the torch path serves
            # (execute_model keeps each step on one path) and loading does not wait for it.
            ek.cpu_ops.start_background_build()
        self.loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=self.device,
            tp=groups.tp,
            pp=groups.pp,
            pack_weights=True,
            quantization=config.quantization,
            expert_parallel=config.parallel.enable_expert_parallel,
            expert_placement_strategy=config.parallel.expert_placement_strategy,
            ep=groups.ep,
        )
        if self.device.type == "cpu":  # after loading: its temporary copies go back
            retain_freed_host_memory()
        limit = self.loaded.config.max_position_embeddings
        max_model_len = limit if config.max_model_len is None else config.max_model_len
        if not isinstance(max_model_len, int) or not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                f"got {max_model_len}"
            )
        self.max_model_len = max_model_len
        # Only the last stage samples: its ranks compile the grammars their matchers use.
        self.grammar_compiler = (
            XGrammarCompiler(config.tokenizer or config.model, self.loaded.config.vocab_size)
            if groups.pp.is_last
            else None
        )
        self.model_runner = ModelRunner(
            self.loaded,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            device=self.device,
            grammar_compiler=self.grammar_compiler,
            speculative_config=config.speculative_config,
            pp=groups.pp,
            step_threads=self.step_threads,
            lora_config=config.lora,
        )
        self.kv_transfer_store: TieredKVStore | None = None
        self.expert_load = ExpertLoadStats(
            self.loaded.model, groups.ep or groups.tp, config.expert_load_log_interval
        )
        # Lock-step with other data-parallel replicas: every step is a forward's collectives.
        self._idle_steps_pass = config.parallel.spans_data_parallel

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    def num_available_blocks(self) -> int:
        """KV blocks this rank's budget holds (a draft model's KV shares them)."""
        budget = kv_cache_budget(
            self.device, self.config.kv_cache_memory, self.config.gpu_memory_utilization
        )
        return self.model_runner.num_kv_blocks_for(budget)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer is not None:
            config = KVTransferConfig.from_dict(self.config.kv_transfer)
            spec = self.model_runner.kv_cache_spec
            self.kv_transfer_store = config.make_store(self.kv_layout_fingerprint())
            groups = self.model_runner.kv_groups
            positions = None
            if len(groups) > 1:  # layer j of every group on cache tensor j
                positions = [0] * sum(len(group.layer_ids) for group in groups)
                for group in groups:
                    for position, layer in enumerate(group.layer_ids):
                        positions[layer] = position
            self.model_runner.register_kv_connector(
                TieredConnectorWorker(
                    self.kv_transfer_store,
                    spec,
                    config.chunk_size,
                    [group.spec for group in groups],
                    positions,
                )
            )

    def kv_layout_fingerprint(self) -> LayoutFingerprint:
        """What keys this rank's shard of the KV chunks (``kv_transfer`` set)."""
        return layout_fingerprint(
            self.loaded.path,
            self.model_runner.kv_cache_spec,
            KVTransferConfig.from_dict(self.config.kv_transfer),
            self.config.prefix_caching_hash_algo,
            self.tp_rank,
            self.loaded.model.local_layers.start,
            [group.spec for group in self.model_runner.kv_groups],
        )

    @property
    def has_kv_connector(self) -> bool:
        return self.config.kv_transfer is not None

    def kv_fingerprint_fields(self) -> dict | None:
        """``kv_layout_fingerprint()``'s fields to rebuild it elsewhere; None without one."""
        if not self.has_kv_connector:
            return None
        fields = dataclasses.asdict(self.kv_layout_fingerprint())
        del fields["digest"]  # derived from the others
        return fields

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.model_runner.execute_model(scheduler_output)
        if self._idle_steps_pass and scheduler_output.total_num_scheduled_tokens == 0:
            idle_expert_pass(self.loaded.model)  # the other replicas' forward needs our experts
        self.expert_load.step()
        return output

    def shutdown(self) -> None:
        """Stop the KV connector's transfers (the tier store's files and connections) and the
        grammar compiler's threads."""
        if self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()
        if self.grammar_compiler is not None:
            self.grammar_compiler.shutdown()


class RankAnswers:
    """Which ranks send their output back each step, and how their outputs become the one the
    engine core sees: the output rank's, with every rank's KV connector report combined (with a
    KV connector every rank answers, since each loads and saves its own shard)."""

    def __init__(self, config: WorkerConfig) -> None:
        parallel = config.parallel
        self.ranks = (
            list(range(parallel.world_size)) if config.kv_transfer else [parallel.output_rank]
        )
        self._output_index = self.ranks.index(parallel.output_rank)
        self._combiner = RankOutputCombiner(len(self.ranks))

    def merge(self, outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        """One step's output from the answering ranks' (in ``ranks`` order)."""
        output = outputs[self._output_index]
        if len(outputs) > 1:
            output.kv_connector_output = self._combiner.combine(
                [rank_output.kv_connector_output for rank_output in outputs]
            )
        return output


def scheduler_side_store(config: WorkerConfig, fingerprint_fields: dict | None):
    """The KV tier store for the scheduler's lookups in the engine core's process, keyed as
    rank 0's shard (``Worker.kv_fingerprint_fields``); None without a connector."""
    if config.kv_transfer is None:
        return None
    store_config = KVTransferConfig.from_dict(config.kv_transfer)
    return store_config.make_store(LayoutFingerprint(**fingerprint_fields))


def model_vocab_size(model: str) -> int:
    """The vocabulary size in a model folder's config (for executors that load no weights)."""
    return DecoderConfig.from_hf_config(load_hf_config(resolve_model_path(model))).vocab_size


def rank_device(rank: int, device: str | None) -> torch.device:
    """The device of ``rank`` on its machine, made current when it is a GPU (nccl needs that):
    ``device`` when given, else one GPU per rank (round robin over the visible ones) or the CPU."""
    if device is not None:
        chosen = torch.device(device)
    elif torch.cuda.is_available():
        chosen = torch.device("cuda", rank % torch.cuda.device_count())
    else:
        chosen = torch.device("cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return chosen


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend for ``device``: nccl on GPUs, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"
