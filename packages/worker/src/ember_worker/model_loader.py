"""Load a Hugging Face checkpoint folder into the decoder.

Weights are read tensor by tensor from memory-mapped safetensors files (one file, or several
with their ``model.safetensors.index.json``) and copied straight into the model's preallocated
parameter shards, so peak memory is the model plus one checkpoint tensor, never two full copies.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ember_kernels import cpu_features
from ember_worker import compressed_tensors
from ember_worker.distributed.groups import SINGLE_STAGE, PipelineStage
from ember_worker.hf_config import HFConfig, load_hf_config, resolve_model_path
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup
from ember_worker.models import DecoderConfig, DecoderForCausalLM, DecoderForSequenceClassification
from ember_worker.models.bamba import BambaForCausalLM
from ember_worker.models.gemma import GemmaConfig, GemmaForCausalLM
from ember_worker.models.mamba_config import MambaHybridConfig
from ember_worker.models.moe_config import with_expert_parallel
from ember_worker.quantization import check_quantization, quantize_model, resolve_quantization

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    """A loaded model with the configuration it was built from."""

    model: DecoderForCausalLM
    config: DecoderConfig
    hf_config: HFConfig
    dtype: torch.dtype
    path: pathlib.Path


def resolve_dtype(
    dtype: str | torch.dtype, hf_config: HFConfig, device: str | torch.device = "cpu"
) -> torch.dtype:
    """The dtype to run in (see ``choose_dtype``)."""
    return choose_dtype(dtype, hf_config, device)[0]


def choose_dtype(
    dtype: str | torch.dtype, hf_config: HFConfig, device: str | torch.device = "cpu"
) -> tuple[torch.dtype, str]:
    """(dtype, why). An explicit dtype is kept. ``"auto"`` takes the checkpoint's dtype (float32
    when it names none), except on a CPU: a float16 checkpoint runs as bfloat16 where the CPU has
    no float16 arithmetic (same exponent range as float32, so no overflow), and a float32 one runs
    as bfloat16 where the CPU has native bfloat16 dot products (AMX or AVX512-BF16: half the
    bytes per token for decode, which is bandwidth-bound), as vLLM's CPU backend chooses."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype}")
        return dtype, "asked for"
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype], "asked for"
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, torch.dtype):
        checkpoint = config_dtype if config_dtype in DTYPES.values() else None
    else:
        checkpoint = DTYPES.get(str(config_dtype).removeprefix("torch."))
    if checkpoint is None:
        return torch.float32, f"auto: the checkpoint names no dtype we run ({config_dtype})"
    on_cpu = torch.device(device).type == "cpu"
    if checkpoint == torch.float16 and on_cpu and not cpu_features.has_fp16_arithmetic():
        return torch.bfloat16, (
            "auto: a float16 checkpoint, run as bfloat16 because this CPU has no float16 "
            f"arithmetic ({cpu_features.describe()})"
        )
    if checkpoint == torch.float32 and on_cpu and cpu_features.has_bf16_arithmetic():
        return torch.bfloat16, (
            "auto: a float32 checkpoint, run as bfloat16 because this CPU has native bfloat16 "
            f"arithmetic ({cpu_features.describe()}); pass dtype='float32' for full precision"
        )
    return checkpoint, "auto: the checkpoint's dtype"


def safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: those its index names, else every one in the folder."""
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names missing shard files {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return files


def iterate_weights(
    files: list[pathlib.Path], keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of ``files`` (that ``keep`` accepts), read one at a time
    from memory maps; tensors not kept are never read."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def load_model(
    model: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    tp: TensorParallelGroup = SINGLE_RANK,
    pp: PipelineStage = SINGLE_STAGE,
    revision: str | None = None,
    pack_weights: bool = False,
    quantization: str | None = None,
    expert_parallel: bool = False,
    expert_placement_strategy: str = "linear",
    ep: TensorParallelGroup | None = None,
) -> LoadedModel:
    """Load a checkpoint of a supported architecture onto ``device`` in ``dtype``.

    Under tensor or pipeline parallelism each rank builds only its shards and stage, and copies
    each checkpoint tensor's slice into them as it is read (tensors of other stages are skipped).
    ``pack_weights`` then packs the linear weights for oneDNN where it can (float32 on the CPU;
    ``DecoderForCausalLM.pack_linear_weights``), as the engine does; off, every weight stays a
    plain tensor. ``quantization`` (``ember_worker.quantization``) is applied after loading,
    before packing; packing leaves int8 weights as they are. A compressed-tensors W8A8
    checkpoint loads its int8 weights and scales as they are (``quantization`` None or
    ``"compressed-tensors"``). ``expert_parallel`` places whole experts of a mixture-of-experts
    model on the ``tp`` ranks (``MoeConfig.expert_parallel``), placed by
    ``expert_placement_strategy`` (over ``ep`` instead where given: data-parallel replicas)."""
    check_quantization(quantization)
    path = resolve_model_path(model, revision=revision)
    hf_config = load_hf_config(path)
    checkpoint = compressed_tensors.checkpoint_quantization(hf_config)
    quantization = resolve_quantization(quantization, checkpoint)
    config = with_expert_parallel(
        DecoderConfig.from_hf_config(hf_config), expert_parallel, expert_placement_strategy, ep
    )
    torch_dtype, why = choose_dtype(dtype, hf_config, device)
    logger.info("running in %s (%s)", str(torch_dtype).removeprefix("torch."), why)
    model_class = DecoderForSequenceClassification if config.num_labels else DecoderForCausalLM
    if isinstance(config, GemmaConfig):
        model_class = GemmaForCausalLM
    elif isinstance(config, MambaHybridConfig):
        model_class = BambaForCausalLM
    with torch.device(device):
        decoder = model_class(config, tp=tp, pp=pp, dtype=torch_dtype)
    weights = iterate_weights(safetensors_files(path), keep=decoder.holds_tensor)
    if checkpoint is not None:
        if config.num_labels:
            raise ValueError(f"{compressed_tensors.FIELD}: a quantized classifier is not supported")
        compressed_tensors.prepare_w8a8(decoder)
        weights = compressed_tensors.w8a8_tensors(weights)
        logger.info("weights: W8A8 int8 (%s checkpoint)", checkpoint)
    decoder.load_weights(weights)
    decoder.eval()
    if quantization is not None and checkpoint is None:
        quantize_model(decoder, quantization)
        logger.info("weights quantized: %s", quantization)
    if pack_weights:
        decoder.pack_linear_weights()
    return LoadedModel(decoder, config, hf_config, torch_dtype, path)
