"""Routing requests across data-parallel engine cores: to the engine that holds the prompt's
prefix, unless that engine is too busy, else to the least-loaded one.

Each engine core reports its prefix-cache changes (``EngineCoreOutputs.kv_events``: blocks stored
and removed, by their chained block hashes). ``EnginePrefixIndex`` mirrors them, so the router
knows exactly which blocks each engine holds. It hashes a request's prompt with the same
``BlockHasher`` (block size, algorithm, seed) as the engines and counts, per engine, how many of
the leading blocks that engine holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ember_kv_cache import BlockHasher, BlockHashExtras
from ember_scheduler.engine_types import KVBlocksStored, KVCacheCleared, KVEvent

# The engine holding a prefix gets the request unless it has more than this many requests in
# flight beyond the least-loaded engine; past that, recomputing the prefix elsewhere is cheaper
# than queueing behind the busy engine.
LOAD_IMBALANCE_THRESHOLD = 8


class EnginePrefixIndex:
    """The block hashes one engine's prefix cache holds, mirrored from its KV events."""

    def __init__(self) -> None:
        self.block_hashes: set[bytes] = set()

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, KVCacheCleared):
                self.block_hashes.clear()
            elif event.group:
                continue  # other layer groups hash under their own seeds; prompts hash as 0's
            elif isinstance(event, KVBlocksStored):
                self.block_hashes.update(event.block_hashes)
            else:
                self.block_hashes.difference_update(event.block_hashes)

    def count_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the leading ``block_hashes`` the engine holds."""
        held = self.block_hashes
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in held:
                return index
        return len(block_hashes)


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    """Where one request went and why: ``"prefix"`` (its engine holds ``matched_blocks`` of the
    prompt's blocks) or ``"load"`` (least loaded: no engine holds any, or the holder is too busy)."""

    engine: int
    reason: str
    matched_blocks: int


class DataParallelRouter:
    """Chooses an engine core for each request and tracks each engine's load and liveness.

    Load is the number of engine requests (``n`` children count ``n``) the front end has sent to
    an engine and not yet seen finish. Ties among the least loaded rotate, so that a stream of
    one-at-a-time requests spreads over the engines.
    """

    def __init__(
        self,
        num_engines: int,
        hasher: BlockHasher,
        load_imbalance_threshold: int = LOAD_IMBALANCE_THRESHOLD,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.hasher = hasher
        self.load_imbalance_threshold = load_imbalance_threshold
        self.indexes = [EnginePrefixIndex() for _ in range(num_engines)]
        self.loads = [0] * num_engines
        self.alive = [True] * num_engines
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (engine, load)
        self._next = 0  # rotates ties among the least loaded

    @property
    def num_engines(self) -> int:
        return len(self.loads)

    def route(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        extras: BlockHashExtras | None = None,
        load: int = 1,
    ) -> RouteDecision:
        """Choose the engine for a request, and count it there until ``finish(request_id)``."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already routed")
        alive = [engine for engine in range(self.num_engines) if self.alive[engine]]
        if not alive:
            raise RuntimeError("no engine core is alive")
        least = self._least_loaded(alive)
        decision = RouteDecision(least, "load", 0)
        if len(alive) > 1:
            # The engine reuses at most the full blocks before the prompt's last token.
            num_blocks = (len(prompt_token_ids) - 1) // self.hasher.block_size
            hashes = self.hasher.hash_prefix(prompt_token_ids, extras, num_blocks)
            matched = {e: self.indexes[e].count_prefix_blocks(hashes) for e in alive}
            holder = max(alive, key=lambda e: (matched[e], -self.loads[e]))
            if (
                matched[holder] > 0
                and self.loads[holder] - self.loads[least] <= self.load_imbalance_threshold
            ):
                decision = RouteDecision(holder, "prefix", matched[holder])
        self._requests[request_id] = (decision.engine, load)
        self.loads[decision.engine] += load
        return decision

    def _least_loaded(self, alive: list[int]) -> int:
        lowest = min(self.loads[e] for e in alive)
        tied = [e for e in alive if self.loads[e] == lowest]
        self._next += 1
        return tied[self._next % len(tied)]

    def finish(self, request_id: str) -> None:
        """The request is done (finished, aborted or failed): stop counting it."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.loads[entry[0]] -= entry[1]

    def engine_of(self, request_id: str) -> int | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

    def requests_on(self, engine: int) -> list[str]:
        return [rid for rid, (e, _) in self._requests.items() if e == engine]

    def apply_events(self, engine: int, events: Iterable[KVEvent]) -> None:
        self.indexes[engine].apply(events)

    def mark_dead(self, engine: int) -> None:
        """Route nothing more to ``engine``; what it held is gone."""
        self.alive[engine] = False
        self.indexes[engine] = EnginePrefixIndex()

    def mark_alive(self, engine: int) -> None:
        """``engine`` was restarted: route to it again (its prefix cache starts empty)."""
        self.alive[engine] = True
        self.indexes[engine] = EnginePrefixIndex()
