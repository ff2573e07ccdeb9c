"""One rank's worker: its shard of the model, its share of the KV cache and its model runner.

Every executor builds its ranks from the same ``WorkerConfig``: the in-process executor runs one
``Worker`` itself; the multiprocess and Ray executors run one per rank elsewhere. Start-up is in
two steps because the ranks must agree on the KV block count: each reports how many blocks its
budget holds, then all allocate the smallest.
"""

from __future__ import annotations

import dataclasses

import msgspec
import torch

from ember_kv_cache import KVTransferConfig, LayoutFingerprint
from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_worker.distributed.groups import ParallelConfig, RankGroups
from ember_worker.hf_config import load_hf_config, resolve_model_path
from ember_worker.kv_cache import kv_cache_budget
from ember_worker.kv_connector import TieredConnectorWorker, layout_fingerprint
from ember_worker.model_loader import load_model
from ember_worker.model_runner import ModelRunner
from ember_worker.models import DecoderConfig
from ember_worker.quantization import check_quantization
from ember_worker.structured_outputs import XGrammarCompiler


class WorkerConfig(msgspec.Struct, frozen=True):
    """Everything a rank needs to load its part of the model; the same for every rank.

    ``kv_cache_memory`` is each rank's budget in bytes (required on the CPU; on a GPU,
    ``gpu_memory_utilization`` of the memory left free by the model when it is None).
    ``num_threads`` sets each rank's torch intra-op threads; None leaves them alone.
    ``kv_transfer`` is vLLM's ``kv_transfer_config`` dict: each rank then moves its own shard of
    the KV chunks, keyed with its tensor-parallel rank's layout fingerprint.
    """

    model: str
    tokenizer: str | None = None  # for structured outputs' grammars; None: the model's folder
    dtype: str = "auto"
    quantization: str | None = None  # ember_worker.quantization.QUANTIZATION_METHODS
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    num_threads: int | None = None
    parallel: ParallelConfig = ParallelConfig()
    kv_transfer: dict | None = None
    prefix_caching_hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        check_quantization(self.quantization, "WorkerConfig.quantization")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or self.num_threads < 1
        ):
            raise ValueError(f"num_threads must be a positive int, got {self.num_threads!r}")
        if self.kv_transfer is not None:
            KVTransferConfig.from_dict(self.kv_transfer)
            if self.parallel.pipeline_parallel_size > 1:
                raise ValueError(
                    "kv_transfer_config is not implemented with pipeline_parallel_size > 1 "
                    "(tensor parallelism only)"
                )


class WorkerFailedError(RuntimeError):
    """A worker rank raised, exited or could not start; the message names the rank."""


class Worker:
    """Loads this rank's part of the model; ``initialize_kv_cache`` then ``execute_model``."""

    def __init__(self, config: WorkerConfig, groups: RankGroups, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.tp_rank = groups.tp.rank
        if config.num_threads is not None:
            # torch's intra-op threads are process-wide; on a small or shared CPU one thread is
            # often fastest for a tiny model (thread wake-ups cost more than the matmuls).
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=device,
            tp=groups.tp,
            pp=groups.pp,
            pack_weights=True,
            quantization=config.quantization,
        )
        limit = self.loaded.config.max_position_embeddings
        max_model_len = limit if config.max_model_len is None else config.max_model_len
        if not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings), "
                f"got {max_model_len}"
            )
        self.max_model_len = max_model_len
        self.grammar_compiler = make_grammar_compiler(config, self.loaded.config.vocab_size)
        self.model_runner = ModelRunner(
            self.loaded,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            device=device,
            grammar_compiler=self.grammar_compiler,
            pp=groups.pp,
        )

    def num_available_blocks(self) -> int:
        """KV blocks this rank's budget holds."""
        budget = kv_cache_budget(
            self.device, self.config.kv_cache_memory, self.config.gpu_memory_utilization
        )
        return self.model_runner.kv_cache_spec.num_blocks_for(budget)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.config.kv_transfer is not None:
            config = KVTransferConfig.from_dict(self.config.kv_transfer)
            spec = self.model_runner.kv_cache_spec
            store = config.make_store(self.kv_layout_fingerprint())
            self.model_runner.register_kv_connector(
                TieredConnectorWorker(store, spec, config.chunk_size)
            )

    def kv_layout_fingerprint(self) -> LayoutFingerprint:
        """What keys this rank's shard of the KV chunks (``kv_transfer`` set)."""
        return layout_fingerprint(
            self.loaded.path,
            self.model_runner.kv_cache_spec,
            KVTransferConfig.from_dict(self.config.kv_transfer),
            self.config.prefix_caching_hash_algo,
            self.tp_rank,
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

    def shutdown(self) -> None:
        """Stop the KV connector's transfers (the tier store's files and connections)."""
        if self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)


def model_vocab_size(model: str) -> int:
    """The vocabulary size in a model folder's config (for executors that load no weights)."""
    return DecoderConfig.from_hf_config(load_hf_config(resolve_model_path(model))).vocab_size


def make_grammar_compiler(config: WorkerConfig, vocab_size: int) -> XGrammarCompiler:
    """The structured-output grammar compiler of ``config``'s tokenizer (each process its own)."""
    return XGrammarCompiler(config.tokenizer or config.model, vocab_size)


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
