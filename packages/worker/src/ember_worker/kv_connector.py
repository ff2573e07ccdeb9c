"""The worker side of the tiered KV connector: chunks between paged KV tensors and the store.

Per step, as vLLM v1's KV connector worker API: ``bind_connector_metadata``; ``start_load_kv``
before the forward (new fetches go to a background thread that reads and checks chunks from the
store across steps; fetched requests the scheduler now expects in their blocks are written layer
by layer on a copy thread); inside the forward, each attention layer calls
``wait_for_layer_load(layer)`` before it reads the cache and ``save_kv_layer(layer)`` right
after it wrote its keys and values (the layer's completed chunks are copied out on a save
thread while the next layers compute); ``wait_for_save`` after the forward (puts them into the
store, so the blocks may be reused next step); ``get_finished`` (the fetches that ended) and
``clear_connector_metadata``. A chunk is an array ``[layers, tensors_per_layer, chunk_size,
num_kv_heads, head_size]`` (``LayoutFingerprint.chunk_shape``: key and value, or MLA's latent
once) in the cache dtype (bfloat16 travels as int16 bits).

With several KV groups (Gemma's local and global layers) layer ``j`` of every group shares
cache tensor ``j`` (``ember_worker.kv_specs``), so a chunk of group ``g`` is those tensors at
``g``'s blocks, ``[layers_per_group, ...]``; each group's entry is its own
(``ember_kv_cache.group_chunks``), and a local group's holds the tail it still kept.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import warnings
from collections.abc import Sequence
from concurrent import futures
from typing import NamedTuple

import numpy as np
import torch

from ember_kv_cache import (
    ChunkTransfer,
    FullAttentionSpec,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferConfig,
    LayoutFingerprint,
    TieredKVStore,
)
from ember_kv_cache.group_chunks import describe_groups, group_hit_holds
from ember_kv_cache.specs import KVCacheSpec as LayerSpec
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
    first_layer: int = 0,
    group_specs: Sequence[LayerSpec] = (),
) -> LayoutFingerprint:
    """The fingerprint of a shard: ``spec``'s layers from ``first_layer`` on (its pipeline
    stage's), ``tp_rank``'s KV heads, and its KV groups' specs."""
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
        first_layer=first_layer,
        tensors_per_layer=spec.tensors_per_layer,
        kv_groups=describe_groups(group_specs or (FullAttentionSpec(),)),
    )


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


class TieredConnectorWorker:
    """Moves KV chunks between this worker's paged cache and a ``TieredKVStore``.

    ``group_specs`` are the KV groups' specs; ``layer_positions`` the cache tensor of each
    attention layer (default: layer ``i`` on tensor ``i``)."""

    def __init__(
        self,
        store: TieredKVStore,
        spec: KVCacheSpec,
        chunk_size: int,
        group_specs: Sequence[LayerSpec] = (),
        layer_positions: Sequence[int] | None = None,
    ) -> None:
        self.store = store
        self.spec = spec
        self.group_specs = tuple(group_specs) or (FullAttentionSpec(),)
        self.layer_positions = list(layer_positions or range(spec.num_layers))
        # A tensor's completed chunks are copied out once the last layer on it has written.
        last_user = {position: layer for layer, position in enumerate(self.layer_positions)}
        self._copy_after = {layer: position for position, layer in last_user.items()}
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // spec.block_size
        # 2: key and value; 1: one cache read as both (MLA's latent), stored once.
        self.parts = spec.tensors_per_layer
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._metadata = KVConnectorMetadata()
        self._fetcher = futures.ThreadPoolExecutor(1, thread_name_prefix="ember-kv-fetch")
        self._copier = futures.ThreadPoolExecutor(1, thread_name_prefix="ember-kv-copy")
        self._saver = futures.ThreadPoolExecutor(1, thread_name_prefix="ember-kv-save")
        self._fetches: dict[str, futures.Future] = {}
        self._fetched: dict[str, list[_FetchedChunk]] = {}
        # This step's writes, one future per layer (empty when nothing is written).
        self._layer_writes: list[futures.Future] = []
        self._layer_saves: list[futures.Future] = []
        # Per save transfer: a host buffer [chunks, layers, parts, blocks_per_chunk, block, heads,
        # size].
        self._save_buffers: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    # ------------------------------------------------------------------ one step

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = KVConnectorMetadata()
        self._layer_writes = []
        self._layer_saves = []
        self._save_buffers = []

    def start_load_kv(self) -> None:
        """Start this step's fetches, drop the discarded, and queue the writes of the fetched
        requests this step expects in their blocks, one copy task per layer in layer order."""
        meta = self._metadata
        loads: dict[str, list[ChunkTransfer]] = {}
        for transfer in meta.loads:
            loads.setdefault(transfer.request_id, []).append(transfer)
        for req_id, transfers in loads.items():
            self._fetches[req_id] = self._fetcher.submit(self._fetch, transfers)
        for req_id in meta.discards:
            self._fetched.pop(req_id, None)
        chunks = [chunk for req_id in meta.writes for chunk in self._fetched.pop(req_id, ())]
        if chunks:
            self._layer_writes = [
                self._copier.submit(self._write_layer, chunks, layer)
                for layer in range(len(self.kv_caches))
            ]
        if meta.saves:
            block_size = self.spec.block_size
            self._save_buffers = [
                self._new_buffer(
                    len(t.chunk_hashes),
                    (t.partial_blocks or self.blocks_per_chunk) - t.skip_tokens // block_size,
                )
                for t in meta.saves
            ]

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until this step's writes of layer ``layer`` are in the paged cache."""
        if self._layer_writes:
            self._layer_writes[self.layer_positions[layer]].result()

    def save_kv_layer(self, layer: int) -> None:
        """Copy layer ``layer`` of this step's completed chunks out of the paged cache (on the
        save thread; called right after the layer wrote this step's keys and values)."""
        position = self._copy_after.get(layer)
        if self._save_buffers and position is not None:
            self._layer_saves.append(self._saver.submit(self._copy_out_layer, position))

    def wait_for_save(self) -> None:
        """Put this step's saved chunks into the store (the paged blocks are free to reuse)."""
        for copy in self._layer_saves:
            copy.result()
        for transfer, buffer in zip(self._metadata.saves, self._save_buffers):
            chunks = buffer.flatten(3, 4)  # [chunks, layers, parts, tokens, heads, head_size]
            for chunk_hash, chunk in zip(transfer.chunk_hashes, chunks):
                self.store.put(chunk_hash, _as_numpy(chunk))

    def get_finished(self, wait: bool = False) -> KVConnectorOutput:
        """Fetches that ended since the last call, with each request's tokens it will have in
        place once written; ``wait`` blocks a little for one when nothing else is running."""
        if wait and self._fetches:
            futures.wait(
                self._fetches.values(), _IDLE_WAIT_SECONDS, return_when=futures.FIRST_COMPLETED
            )
        finished = {}
        for req_id in [req_id for req_id, future in self._fetches.items() if future.done()]:
            in_place, chunks = self._fetches.pop(req_id).result()
            self._fetched[req_id] = chunks
            finished[req_id] = in_place
        return KVConnectorOutput(finished)

    # ------------------------------------------------------------------ the runner's two calls

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Before the forward: take the step's metadata, start its fetches and writes."""
        self.bind_connector_metadata(metadata or KVConnectorMetadata())
        self.start_load_kv()

    def finish_step(self, idle: bool) -> KVConnectorOutput:
        """After the forward (or in a step that computed nothing): finish the writes (a step
        without a forward has no attention layer to wait for them), save, report, clear."""
        for write in self._layer_writes:
            write.result()
        if self._metadata.saves:
            if not self._layer_saves:  # no forward ran: nothing new was computed, but copy out
                for position in range(len(self.kv_caches)):
                    self._layer_saves.append(self._saver.submit(self._copy_out_layer, position))
            self.wait_for_save()
        output = self.get_finished(wait=idle)
        # One per request, though each of its groups saved its own part.
        saved = (t.request_id for t in self._metadata.saves if t.partial_blocks)
        output.finished_saving = list(dict.fromkeys(saved))
        self.clear_connector_metadata()
        return output

    def shutdown(self) -> None:
        for pool in (self._fetcher, self._copier, self._saver):
            pool.shutdown(wait=True)
        self.store.close()

    # ------------------------------------------------------------------ helpers

    def _new_buffer(self, num_chunks: int, blocks_per_chunk: int) -> torch.Tensor:
        spec = self.spec
        return torch.empty(
            num_chunks, spec.num_layers, self.parts, blocks_per_chunk, spec.block_size,
            spec.num_kv_heads, spec.head_size, dtype=spec.dtype,
        )  # fmt: skip

    def _chunk_block_ids(self, transfer: ChunkTransfer, device: torch.device) -> torch.Tensor:
        per_chunk = self.blocks_per_chunk
        start = transfer.first_chunk * per_chunk
        end = start + (transfer.partial_blocks or len(transfer.chunk_hashes) * per_chunk)
        start += transfer.skip_tokens // self.spec.block_size  # left the window: not held
        return torch.tensor(transfer.block_ids[start:end], dtype=torch.long, device=device)

    @torch.inference_mode()  # the runner's tensors are inference tensors; threads start outside
    def _copy_out_layer(self, layer: int) -> None:
        key_cache, value_cache = self.kv_caches[layer]
        for transfer, buffer in zip(self._metadata.saves, self._save_buffers):
            blocks = self._chunk_block_ids(transfer, key_cache.device)
            shape = buffer.shape[3:]
            buffer[:, layer, 0] = key_cache.index_select(0, blocks).view(-1, *shape).cpu()
            if self.parts == 2:
                buffer[:, layer, 1] = value_cache.index_select(0, blocks).view(-1, *shape).cpu()

    def _fetch(self, transfers: list[ChunkTransfer]) -> tuple[int, list[_FetchedChunk]]:
        """Read and check a request's chunks (one transfer per KV group), each group up to its
        first that is missing or damaged; returns the request's tokens in place once they are
        written (the longest prefix every group can continue from), and the chunks."""
        block_size = self.spec.block_size
        per_chunk = self.blocks_per_chunk
        head = transfers[0]
        local_blocks = (head.first_chunk * self.chunk_size + head.skip_tokens) // block_size
        last = len(head.chunk_hashes) - 1
        ends = [(head.first_chunk + i + 1) * per_chunk for i in range(last + 1)]
        if head.partial_blocks:
            ends[-1] += head.partial_blocks - per_chunk
        held = np.zeros((len(self.group_specs), ends[-1]), dtype=bool)
        fetched = []
        try:
            for transfer in transfers:
                for offset, chunk_hash in enumerate(transfer.chunk_hashes):
                    if not chunk_hash:
                        continue  # the group's next query does not read this chunk
                    partial = offset == last and transfer.partial_blocks
                    use = transfer.partial_blocks if partial else per_chunk
                    stored = (transfer.stored_blocks or use) if partial else per_chunk
                    chunk = self.store.get(chunk_hash)
                    num_held = self._held_blocks(chunk, stored)
                    if not num_held:
                        break
                    first_held = stored - num_held  # the blocks before had left the window
                    skip = transfer.skip_tokens // block_size if offset == 0 else 0
                    low = max(first_held, skip)
                    start = (transfer.first_chunk + offset) * per_chunk
                    if low < use:
                        block_ids = transfer.block_ids[start + low : start + use]
                        fetched.append(self._fetched_chunk(chunk, block_ids, low - first_held))
                        held[transfer.group, start + low : start + use] = True
        except Exception:
            logger.exception(
                "KV load of request %s failed; the rest is recomputed", head.request_id
            )
        in_place = local_blocks * block_size
        for end in ends:
            if group_hit_holds(self.group_specs, block_size, held, local_blocks, end):
                in_place = end * block_size
        return in_place, fetched

    def _held_blocks(self, chunk: object, stored_blocks: int) -> int:
        """How many blocks a stored entry of this layout holds, the tail of a chunk's first
        ``stored_blocks`` (all of them but for a local group's); 0 if it is no such entry."""
        spec = self.spec
        if not isinstance(chunk, np.ndarray) or chunk.ndim != 5:
            return 0
        tokens = chunk.shape[2]
        layout = (chunk.shape[:2], chunk.shape[3:]) == (
            (spec.num_layers, self.parts),
            (spec.num_kv_heads, spec.head_size),
        )
        if not layout or tokens % spec.block_size or tokens > stored_blocks * spec.block_size:
            return 0
        return tokens // spec.block_size

    def _fetched_chunk(
        self, chunk: np.ndarray, block_ids: list[int], skip_blocks: int
    ) -> _FetchedChunk:
        spec = self.spec
        with warnings.catch_warnings():  # the chunk is read-only and is only read from
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(chunk)
        if spec.dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        blocks = tensor.view(
            spec.num_layers, self.parts, -1, spec.block_size, spec.num_kv_heads, spec.head_size
        )[:, :, skip_blocks : skip_blocks + len(block_ids)]
        device = self.kv_caches[0][0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        return _FetchedChunk(index, blocks)

    @torch.inference_mode()
    def _write_layer(self, chunks: list[_FetchedChunk], layer: int) -> None:
        key_cache, value_cache = self.kv_caches[layer]
        for chunk in chunks:
            key_cache.index_copy_(0, chunk.block_ids, chunk.blocks[layer, 0].to(key_cache.device))
            if self.parts == 2:  # else the value cache is the key cache, written just now
                value_cache.index_copy_(
                    0, chunk.block_ids, chunk.blocks[layer, 1].to(value_cache.device)
                )


class _FetchedChunk(NamedTuple):
    """A chunk read from the store, waiting to be written into ``block_ids`` (a device index
    tensor); ``blocks`` is ``[layers, parts, blocks, block_size, heads, head_size]`` on the
    host."""

    block_ids: torch.Tensor
    blocks: torch.Tensor
