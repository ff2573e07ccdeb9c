"""The scheduler's side of a KV connector: requests waiting for their KV, and step metadata.

A waiting request whose prompt continues, past the local prefix hit, in the connector's tier
store gets blocks for those tokens and waits in ``WAITING_FOR_REMOTE_KVS`` (outside the waiting
queue, so others keep being admitted) while the worker loads them. When the worker reports the
load, the tokens it placed count as computed and the request goes back to the front of the
waiting queue; what could not be loaded is computed as usual. A request that finishes while the
connector saves its last partial chunk keeps its blocks until the worker reports that save.
"""

from __future__ import annotations

from collections.abc import Iterable

from ember_kv_cache import (
    ComputedBlocks,
    KVCacheManager,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorStats,
    TieredConnectorScheduler,
)
from ember_scheduler.request import Request, RequestStatus


class KVTransferScheduling:
    """Drives a ``TieredConnectorScheduler`` for one ``Scheduler``."""

    def __init__(
        self, connector: TieredConnectorScheduler, kv_cache_manager: KVCacheManager
    ) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self.loading: dict[str, Request] = {}
        self.saving: set[str] = set()  # finished requests whose blocks wait for a save

    def start_load(self, request: Request, computed: ComputedBlocks) -> bool | None:
        """After a waiting request's local prefix lookup: True if it now waits for tokens from
        the store (it holds blocks for them), False if there is nothing to load, None if the
        pool has no room for them (nothing changed)."""
        req_id = request.request_id
        num_external, _ = self.connector.get_num_new_matched_tokens(
            req_id, request.all_token_ids, computed.num_computed_tokens, request.block_hash_extras
        )
        if not num_external:
            return False
        kv = self.kv_cache_manager
        new_block_ids = kv.allocate_slots(
            req_id,
            request.all_token_ids,
            num_external,
            computed=computed,
            extras=request.block_hash_extras,
            delay_cache_blocks=True,
        )
        if new_block_ids is None:
            return None
        self.connector.update_state_after_alloc(req_id, self.group_block_ids(req_id), num_external)
        request.set_status(RequestStatus.WAITING_FOR_REMOTE_KVS)
        self.loading[req_id] = request
        return True

    def update_from_output(self, output: KVConnectorOutput | None) -> list[Request]:
        """Requests whose load ended, ready to be scheduled, with their loaded tokens counted
        as computed (and cached). Requests aborted while loading, and finished requests whose
        save ended, are freed now."""
        loaded, saved = self.connector.update_connector_output(output)
        for req_id in saved:
            self.saving.discard(req_id)
            self.kv_cache_manager.free(req_id)
        ready = []
        for req_id, num_tokens in loaded.items():
            request = self.loading.pop(req_id, None)
            if request is None:
                continue
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.kv_cache_manager.free(req_id)  # aborted while its blocks were being written
                self.connector.request_finished(req_id)
                continue
            self.connector.record_loaded(num_tokens - request.num_computed_tokens)
            request.num_computed_tokens = num_tokens
            request.num_cached_tokens = num_tokens
            request.set_status(RequestStatus.WAITING)
            ready.append(request)
        return ready

    def build_connector_meta(
        self, scheduled: Iterable[Request], num_scheduled_tokens: dict[str, int]
    ) -> KVConnectorMetadata:
        """This step's loads and saves for the worker (``num_computed_tokens`` already counts
        this step's tokens)."""
        return self.connector.build_connector_meta(
            (
                (r.request_id, r.all_token_ids, r.num_computed_tokens)
                for r in scheduled
                if r.request_id in num_scheduled_tokens
            ),
            self.group_block_ids,
        )

    def request_finished(self, request: Request) -> None:
        """An aborted request: forget it (its blocks are freed by the caller)."""
        self.connector.request_finished(request.request_id)

    def free_after_save(self, request: Request) -> None:
        """A request that ended normally: free its blocks now, or once the connector has
        saved its last partial chunk."""
        req_id = request.request_id
        delay, _ = self.connector.request_finished(
            req_id,
            request.prompt_token_ids,
            request.num_computed_tokens,
            self.group_block_ids(req_id),
        )
        if delay:
            self.saving.add(req_id)
        else:
            self.kv_cache_manager.free(req_id)

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each KV group (one group for a plain manager)."""
        kv = self.kv_cache_manager
        if hasattr(kv, "get_group_block_ids"):
            return kv.get_group_block_ids(request_id)
        return (kv.get_block_ids(request_id),)

    def has_transfers(self) -> bool:
        """Whether requests wait for a load, or finished ones for a save."""
        return bool(self.loading) or bool(self.saving)

    def take_stats(self) -> KVConnectorStats:
        return self.connector.take_stats()
