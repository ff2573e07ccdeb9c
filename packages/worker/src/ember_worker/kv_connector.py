"""The worker side of the tiered KV connector: chunks between paged KV tensors and the store.

Per step, as vLLM v1's KV connector worker API: ``bind_connector_metadata``, ``start_load_kv``
before the forward (loads run on a background thread, overlapping the forward, into blocks no
scheduled request reads), ``save_kv_layer`` per layer after the forward (copies this step's
completed chunks out of the paged cache, so the blocks may be reused next step),
``wait_for_save`` (puts them into the store), ``get_finished`` (the loads that ended) and
``clear_connector_metadata``. A chunk is an array ``[layers, 2 (key, value), chunk_size,
num_kv_heads, head_size]`` in the cache dtype (bfloat16 travels as int16 bits).
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import warnings
from concurrent import futures

import numpy as np
import torch

from ember_kv_cache import (
    ChunkTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferConfig,
    LayoutFingerprint,
    TieredKVStore,
)
from ember_worker.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)
# How long an idle step (nothing to compute, loads in flight) waits for one to end.
_IDLE_WAIT_SECONDS = 0.05
_SAMPLE_BYTES = 1 << 20


def model_identity(path: pathlib.Path) -> str:
    """A name for a checkpoint's weights that another process computes the same way: its folder
    name and a digest of config.json and each weight file's name, size, first and last MiB."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            handle.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(handle.read(_SAMPLE_BYTES))
    return f"{path.name}@{digest.hexdigest()}"


def layout_fingerprint(
    model_path: pathlib.Path,
    spec: KVCacheSpec,
    config: KVTransferConfig,
    hash_algo: str,
    tp_rank: int,
) -> LayoutFingerprint:
    return LayoutFingerprint(
        model=model_identity(model_path),
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tp_rank=tp_rank,
        chunk_size=config.chunk_size,
        hash_algo=hash_algo,
    )


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


class TieredConnectorWorker:
    """Moves KV chunks between this worker's paged cache and a ``TieredKVStore``."""

    def __init__(self, store: TieredKVStore, spec: KVCacheSpec, chunk_size: int) -> None:
        self.store = store
        self.spec = spec
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // spec.block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._metadata = KVConnectorMetadata()
        self._loader = futures.ThreadPoolExecutor(1, thread_name_prefix="ember-kv-load")
        self._loads: dict[str, futures.Future] = {}
        # Per save transfer: a host buffer [chunks, layers, 2, blocks_per_chunk, block, heads, size].
        self._save_buffers: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    # ------------------------------------------------------------------ one step

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = KVConnectorMetadata()
        self._save_buffers = []

    def start_load_kv(self) -> None:
        """Start this step's loads on the loader thread."""
        for transfer in self._metadata.loads:
            self._loads[transfer.request_id] = self._loader.submit(self._load, transfer)

    def save_kv_layer(self, layer: int) -> None:
        """Copy layer ``layer`` of this step's completed chunks out of the paged cache."""
        if not self._save_buffers:
            self._save_buffers = [
                self._new_buffer(len(t.chunk_hashes)) for t in self._metadata.saves
            ]
        key_cache, value_cache = self.kv_caches[layer]
        for transfer, buffer in zip(self._metadata.saves, self._save_buffers):
            blocks = self._chunk_block_ids(transfer, key_cache.device)
            shape = buffer.shape[3:]
            buffer[:, layer, 0] = key_cache.index_select(0, blocks).view(-1, *shape).cpu()
            buffer[:, layer, 1] = value_cache.index_select(0, blocks).view(-1, *shape).cpu()

    def wait_for_save(self) -> None:
        """Put this step's saved chunks into the store (the paged blocks are free to reuse)."""
        spec = self.spec
        for transfer, buffer in zip(self._metadata.saves, self._save_buffers):
            chunks = buffer.view(
                len(transfer.chunk_hashes), spec.num_layers, 2, self.chunk_size,
                spec.num_kv_heads, spec.head_size,
            )  # fmt: skip
            for chunk_hash, chunk in zip(transfer.chunk_hashes, chunks):
                self.store.put(chunk_hash, _as_numpy(chunk))

    def get_finished(self, wait: bool = False) -> KVConnectorOutput:
        """Loads that ended since the last call, with each request's tokens now in place;
        ``wait`` blocks a little for one when nothing else is running."""
        if wait and self._loads:
            futures.wait(
                self._loads.values(), _IDLE_WAIT_SECONDS, return_when=futures.FIRST_COMPLETED
            )
        done = [req_id for req_id, future in self._loads.items() if future.done()]
        return KVConnectorOutput({req_id: self._loads.pop(req_id).result() for req_id in done})

    # ------------------------------------------------------------------ the runner's two calls

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Before the forward: take the step's metadata and start its loads."""
        self.bind_connector_metadata(metadata or KVConnectorMetadata())
        self.start_load_kv()

    def finish_step(self, idle: bool) -> KVConnectorOutput:
        """After the forward (or in a step that computed nothing): save, report, clear."""
        if self._metadata.saves:
            for layer in range(self.spec.num_layers):
                self.save_kv_layer(layer)
            self.wait_for_save()
        output = self.get_finished(wait=idle)
        self.clear_connector_metadata()
        return output

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self.store.close()

    # ------------------------------------------------------------------ helpers

    def _new_buffer(self, num_chunks: int) -> torch.Tensor:
        spec = self.spec
        return torch.empty(
            num_chunks, spec.num_layers, 2, self.blocks_per_chunk, spec.block_size,
            spec.num_kv_heads, spec.head_size, dtype=spec.dtype,
        )  # fmt: skip

    def _chunk_block_ids(self, transfer: ChunkTransfer, device: torch.device) -> torch.Tensor:
        per_chunk = self.blocks_per_chunk
        start = transfer.first_chunk * per_chunk
        end = start + len(transfer.chunk_hashes) * per_chunk
        return torch.tensor(transfer.block_ids[start:end], dtype=torch.long, device=device)

    def _load(self, transfer: ChunkTransfer) -> int:
        """Copy the transfer's chunks into the request's blocks, in order, up to the first that
        is missing or damaged; returns the request's tokens in place afterwards."""
        spec = self.spec
        size = self.chunk_size
        in_place = transfer.first_chunk * size + transfer.skip_tokens
        expected = (spec.num_layers, 2, size, spec.num_kv_heads, spec.head_size)
        try:
            for offset, chunk_hash in enumerate(transfer.chunk_hashes):
                chunk = self.store.get(chunk_hash)
                if not isinstance(chunk, np.ndarray) or chunk.shape != expected:
                    break
                index = transfer.first_chunk + offset
                skip_blocks = transfer.skip_tokens // spec.block_size if offset == 0 else 0
                per_chunk = self.blocks_per_chunk
                block_ids = transfer.block_ids[
                    index * per_chunk + skip_blocks : (index + 1) * per_chunk
                ]
                self._write_chunk(chunk, block_ids, skip_blocks)
                in_place = (index + 1) * size
        except Exception:
            logger.exception(
                "KV load of request %s failed; the rest is recomputed", transfer.request_id
            )
        return in_place

    def _write_chunk(self, chunk: np.ndarray, block_ids: list[int], skip_blocks: int) -> None:
        spec = self.spec
        with warnings.catch_warnings():  # the chunk is read-only and is only read from
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(chunk)
        if spec.dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        blocks = tensor.view(
            spec.num_layers, 2, self.blocks_per_chunk, spec.block_size, spec.num_kv_heads,
            spec.head_size,
        )[:, :, skip_blocks:]  # fmt: skip
        device = self.kv_caches[0][0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        blocks = blocks.to(device)
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            key_cache.index_copy_(0, index, blocks[layer, 0])
            value_cache.index_copy_(0, index, blocks[layer, 1])
