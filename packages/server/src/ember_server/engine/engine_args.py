"""Engine settings shared by the offline ``LLM``, ``AsyncLLM`` and the ``ember`` CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from ember_kv_cache import DEFAULT_HASH_ALGO, HASH_ALGOS, KVTransferConfig
from ember_scheduler.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SCHEDULING_POLICIES,
    check_int,
)
from ember_scheduler.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig
from ember_server.engine.admission import check_timeout
from ember_server.engine.lora_args import add_lora_cli_args, make_lora_config
from ember_spec_decode import SpeculativeConfig
from ember_worker.executor_factory import EXECUTOR_BACKENDS
from ember_worker.expert_placement import EXPERT_PLACEMENT_STRATEGIES
from ember_worker.quantization import QUANTIZATION_METHODS, check_quantization

_DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("last", "mean", "cls")
# Restarts of a dead engine core within RESTART_WINDOW seconds before the server gives up.
DEFAULT_MAX_ENGINE_RESTARTS = 3
RESTART_WINDOW = 300.0
# Whether ``async_scheduling`` is on when not given (README: measured in bench_async_scheduling).
DEFAULT_ASYNC_SCHEDULING = False
_BYTE_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
}


def parse_bytes(text: str | int) -> int:
    """``"512MiB"``, ``"2G"``, ``"1048576"`` -> bytes (decimal K/M/G, binary Ki/Mi/Gi; 'B' optional)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise ValueError(
            f"kv_cache_memory must be a byte count such as 536870912 or 512MiB, got {text!r}"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2) or ""])


@dataclasses.dataclass
class EngineArgs:
    """Everything needed to build an engine; the fields are the CLI's flags (``--max-model-len``...).

    ``None`` means "derive it": ``max_model_len`` from the model's config,
    ``max_num_batched_tokens`` as ``max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)``,
    ``kv_cache_memory`` as 256 MiB on the CPU (on a GPU the worker takes
    ``gpu_memory_utilization`` of the memory left free by the model; None: the worker's default),
    ``tokenizer`` and ``served_model_name`` from ``model``, ``num_threads`` (torch's CPU threads in
    the engine, every step) as every core, less one under ``ember serve`` in steps under 32
    tokens while other processes use a core (see ``default_step_threads``), shared among the
    worker ranks when there are several and among the engine cores under data parallelism.
    ``kv_transfer_config`` is vLLM's: ``{"kv_connector": "TieredConnector", "kv_role":
    "kv_both", "kv_connector_extra_config": {"chunk_size": 256, "tiers": [...]}}``.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    # "int8_weight_only" (applied to the weights after loading) or "compressed-tensors" (a W8A8
    # checkpoint's own, found from its config.json when None); ember_worker.quantization.
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None  # bytes for the KV cache tensors
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # The chain hash of prefix-cache blocks, which also keys a KV connector's stored chunks.
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    served_model_name: str | None = None
    seed: int = 0
    scheduling_policy: str = "fcfs"  # or "priority": lower ``priority`` values run first
    num_threads: int | None = None
    kv_transfer_config: dict | None = None
    # "generate" (text, and pooling on the side), "pooling" (embed/classify/score only), or
    # "auto": pooling for a *ForSequenceClassification checkpoint, else generate.
    runner: str = "auto"
    pooling_type: str = "last"  # how embeddings pool the prompt: last token, mean, or cls
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Mixture-of-experts layers: whole experts split over the tensor-parallel ranks (vLLM's flag)
    # instead of every expert's intermediate dimension.
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"  # which rank holds which experts (vLLM's name)
    # Log the MoE layers' per-expert load (vLLM's EPLB statistics) every this many steps; 0: never.
    expert_load_log_interval: int = 0
    distributed_executor_backend: str | None = None  # uni, mp or ray; None: uni or mp by ranks
    # vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4, ...}) is converted
    speculative_config: SpeculativeConfig | None = None
    # Engine cores behind one front end (``ember serve``), each with its own KV cache and workers.
    data_parallel_size: int = 1
    # Schedule step n+1 while the model runs step n. None: on where it is supported and wins
    # (``use_async_scheduling``).
    async_scheduling: bool | None = None
    # Admission control of the serving front end (``engine.admission``): requests sent but not
    # yet started past which new ones get a 503, and the deadline of a request without its own.
    max_num_waiting_requests: int | None = None
    request_timeout: float | None = None
    # Restarts of a dead engine core (its requests move on) before the server fails; 0: none.
    max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS
    # LoRA adapters (``lora_args``): off unless enable_lora.
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError(f"EngineArgs.model must name a model folder, got {self.model!r}")
        self.model = str(self.model)  # accept os.PathLike
        if self.tokenizer is not None:
            self.tokenizer = str(self.tokenizer)
        check_quantization(self.quantization, "EngineArgs.quantization")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory", "num_threads"):
            check_int(f"EngineArgs.{name}", getattr(self, name), optional=True)
        for name in (
            "max_num_seqs",
            "block_size",
            "data_parallel_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            check_int(f"EngineArgs.{name}", getattr(self, name))
        for name, choices in (
            ("dtype", _DTYPES),
            ("scheduling_policy", SCHEDULING_POLICIES),
            ("prefix_caching_hash_algo", HASH_ALGOS),
            ("distributed_executor_backend", (None, *EXECUTOR_BACKENDS)),
            ("runner", RUNNERS),
            ("pooling_type", POOLING_TYPES),
            ("expert_placement_strategy", EXPERT_PLACEMENT_STRATEGIES),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"EngineArgs.{name} must be one of {choices}, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                "EngineArgs.enable_expert_parallel must be a bool, got "
                f"{self.enable_expert_parallel!r}"
            )
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            _check_lockstep(self)
        if not isinstance(self.seed, int):
            raise ValueError(f"EngineArgs.seed must be an integer, got {self.seed!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.kv_transfer_config is not None:
            KVTransferConfig.from_dict(self.kv_transfer_config)
            if not self.enable_prefix_caching:
                raise ValueError("EngineArgs.kv_transfer_config needs enable_prefix_caching")
        check_int(
            "EngineArgs.max_num_waiting_requests", self.max_num_waiting_requests, optional=True
        )
        check_timeout(self.request_timeout, "EngineArgs.request_timeout")
        check_int("EngineArgs.max_engine_restarts", self.max_engine_restarts, minimum=0)
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"EngineArgs.async_scheduling must be a bool or None, got {self.async_scheduling!r}"
            )
        make_lora_config(self)

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The adapter limits the scheduler and workers receive (None: LoRA off)."""
        return make_lora_config(self)

    @property
    def use_async_scheduling(self) -> bool:
        """``async_scheduling``, or where None, its default (every setting composes with it)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        # Lock-step data-parallel engine cores send one step per pass (``lockstep``).
        return DEFAULT_ASYNC_SCHEDULING and not (
            self.enable_expert_parallel and self.data_parallel_size > 1
        )

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """``kv_transfer_config``, validated (None without one)."""
        if self.kv_transfer_config is None:
            return None
        return KVTransferConfig.from_dict(self.kv_transfer_config)

    @property
    def model_name(self) -> str:
        """The name clients use for this model (``served_model_name`` or ``model``)."""
        return self.served_model_name or self.model

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field (``--model``, ``--max-model-len``, ...) to ``parser``."""
        group = parser.add_argument_group("engine")
        group.add_argument("--model", default=None, help="Hugging Face model folder.")
        group.add_argument(
            "--tokenizer", default=None, help="Tokenizer folder (default: the model's)."
        )
        group.add_argument("--dtype", default="auto", choices=_DTYPES, help="Weight dtype.")
        group.add_argument(
            "--quantization",
            default=None,
            choices=QUANTIZATION_METHODS,
            help="Quantize the weights after loading (int8_weight_only: int8 with a scale per "
            "group of 128 inputs, q/k/v and activations in --dtype), or compressed-tensors: a "
            "W8A8 int8 checkpoint's own "
            "(found from its config.json without this flag).",
        )
        group.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="Context length (prompt + output); default: the model's.",
        )
        group.add_argument(
            "--max-num-seqs",
            type=int,
            default=DEFAULT_MAX_NUM_SEQS,
            help="Most requests in one step.",
        )
        group.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="Token budget of one step; default: max(max-model-len, "
            f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}).",
        )
        group.add_argument(
            "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="Tokens per KV block."
        )
        group.add_argument(
            "--kv-cache-memory",
            type=parse_bytes,
            default=None,
            help="Bytes for the KV cache, e.g. 536870912 or 512MiB; default: 256MiB on the CPU, "
            "90%% of the free memory on a GPU.",
        )
        group.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=None,
            help="Share of the GPU memory left free by the model that the KV cache takes, in "
            "(0, 1]; default: the worker's (0.9). Ignored with --kv-cache-memory.",
        )
        group.add_argument(
            "--prefix-caching-hash-algo",
            default=DEFAULT_HASH_ALGO,
            choices=HASH_ALGOS,
            help="Chain hash of prefix-cache blocks (also keys a KV connector's stored chunks); "
            "xxhash64 and xxhash128 need the xxhash package.",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Reuse the KV of shared prompt prefixes.",
        )
        group.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Schedule the next step while the model runs this one. Default: "
            f"{'on' if DEFAULT_ASYNC_SCHEDULING else 'off'}.",
        )
        group.add_argument(
            "--served-model-name", default=None, help="Model name in the API (default: --model)."
        )
        group.add_argument("--seed", type=int, default=0, help="Random seed of the engine.")
        group.add_argument(
            "--scheduling-policy",
            default="fcfs",
            choices=SCHEDULING_POLICIES,
            help="fcfs: first come, first served; priority: lower request priority runs first.",
        )
        group.add_argument(
            "--num-threads",
            type=int,
            default=None,
            help="torch CPU threads of the engine; default: available cores minus one, at least 1.",
        )
        group.add_argument(
            "--kv-transfer-config",
            type=_json_object,
            default=None,
            help='KV connector as JSON, e.g. \'{"kv_connector": "TieredConnector", "kv_role": '
            '"kv_both", "kv_connector_extra_config": {"chunk_size": 256, "tiers": [{"type": '
            '"disk", "path": "/tmp/kv", "max_bytes": 10000000000}]}}\'.',
        )
        group.add_argument(
            "--speculative-config",
            type=_json_object,
            default=None,
            help='Speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"method": '
            '"draft_model", "model": "PATH", "num_speculative_tokens": 4}\'.',
        )
        group.add_argument(
            "--runner",
            default="auto",
            choices=RUNNERS,
            help="generate: text generation (embeddings too); pooling: embed, classify and score "
            "only; auto: pooling for a sequence classification checkpoint, else generate.",
        )
        group.add_argument(
            "--pooling-type",
            default="last",
            choices=POOLING_TYPES,
            help="How embeddings pool the prompt's hidden states.",
        )
        group.add_argument(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=1,
            help="Engine cores behind this server, each with its own KV cache; requests go to "
            "the engine holding their prompt's prefix, else to the least loaded.",
        )
        group.add_argument(
            "-tp",
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="Ranks that split each layer (heads, MLP columns, vocabulary).",
        )
        group.add_argument(
            "-pp",
            "--pipeline-parallel-size",
            type=int,
            default=1,
            help="Pipeline stages that split the layers.",
        )
        group.add_argument(
            "--enable-expert-parallel",
            action="store_true",
            help="Mixture-of-experts models: place whole experts on the tensor-parallel ranks "
            "(a contiguous, balanced share each; shared experts whole on every rank) and send "
            "tokens to their experts' ranks by all-to-all, instead of splitting every expert. "
            "With --data-parallel-size: every engine core's ranks form one expert-parallel "
            "group and the engine cores step in lock-step.",
        )
        group.add_argument(
            "--expert-placement-strategy",
            choices=EXPERT_PLACEMENT_STRATEGIES,
            default="linear",
            help="With --enable-expert-parallel: 'linear' gives each rank a contiguous block of "
            "experts, 'round_robin' deals expert e to rank e %% ranks.",
        )
        group.add_argument(
            "--expert-load-log-interval",
            type=int,
            default=0,
            help="Mixture-of-experts models: every this many steps, log the tokens routed to "
            "each layer's experts since the last log (balancedness and the hottest expert); "
            "0 never logs.",
        )
        group.add_argument(
            "--distributed-executor-backend",
            default=None,
            choices=EXECUTOR_BACKENDS,
            help="uni: one rank in the engine process; mp: one process per rank on this machine; "
            "ray: Ray actors across a Ray cluster. Default: uni for one rank, else mp.",
        )
        group.add_argument(
            "--max-num-waiting-requests",
            type=int,
            default=None,
            help="Requests sent to the engine but not yet started (queued or prefilling) past "
            "which new ones get a 503 with Retry-After. Default: no bound.",
        )
        group.add_argument(
            "--request-timeout",
            type=float,
            default=None,
            help="Seconds a request may take before it is aborted (a body's 'timeout' wins). "
            "Default: none.",
        )
        group.add_argument(
            "--max-engine-restarts",
            type=int,
            default=DEFAULT_MAX_ENGINE_RESTARTS,
            help=f"Restarts of a dead engine core within {RESTART_WINDOW:g} s (its requests move "
            "to a live or restarted engine) before the server gives up and exits 1; 0: fail at "
            "once.",
        )
        add_lora_cli_args(group)
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """Build from a namespace parsed with ``add_cli_args`` (extra attributes are ignored)."""
        values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)


def _check_lockstep(args: EngineArgs) -> None:
    """What data-parallel attention with expert parallelism (``lockstep``) runs with: worker
    processes, one pipeline stage, and one model step per engine core pass."""
    if args.distributed_executor_backend not in (None, "mp"):
        raise ValueError(
            "EngineArgs.distributed_executor_backend: data-parallel attention with expert "
            f"parallelism runs on 'mp', got {args.distributed_executor_backend!r}"
        )
    if args.pipeline_parallel_size > 1:
        raise ValueError(
            "EngineArgs.pipeline_parallel_size: data-parallel attention with expert parallelism "
            f"runs one pipeline stage, got {args.pipeline_parallel_size}"
        )
    if args.async_scheduling:
        raise ValueError(
            "EngineArgs.async_scheduling: data-parallel attention with expert parallelism "
            "steps its engine cores in lock-step, one step at a time"
        )


def _json_object(text: str) -> dict:
    """A JSON object from the command line (argparse reports the error as a usage error)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
