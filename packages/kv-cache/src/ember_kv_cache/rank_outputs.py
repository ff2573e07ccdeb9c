"""Combine the connector outputs of several ranks into the one the scheduler sees.

Each rank (a tensor-parallel shard of a pipeline stage's layers) loads and saves its own shard of
a request's KV, in its own time: a load or a save is
done only when every rank has reported it, possibly in different steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from ember_kv_cache.connector import KVConnectorOutput


class RankOutputCombiner:
    """Holds what some ranks reported until the rest do; ``combine`` once per step."""

    def __init__(self, num_ranks: int) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        self.num_ranks = num_ranks
        self._loads: dict[str, tuple[int, int]] = {}  # request -> (ranks reported, fewest tokens)
        self._saves: dict[str, int] = {}  # request -> ranks reported

    def combine(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput:
        """The loads every rank has now finished (with the fewest tokens any rank holds in
        place, so a miss on one rank is a miss on all) and the saves every rank has finished."""
        if len(outputs) != self.num_ranks:
            raise ValueError(f"expected {self.num_ranks} rank outputs, got {len(outputs)}")
        combined = KVConnectorOutput()
        for output in outputs:
            if output is None:
                continue
            for request_id, num_tokens in output.finished_loading.items():
                count, fewest = self._loads.get(request_id, (0, num_tokens))
                count, fewest = count + 1, min(fewest, num_tokens)
                if count == self.num_ranks:
                    self._loads.pop(request_id, None)
                    combined.finished_loading[request_id] = fewest
                else:
                    self._loads[request_id] = (count, fewest)
            for request_id in output.finished_saving:
                count = self._saves.get(request_id, 0) + 1
                if count == self.num_ranks:
                    self._saves.pop(request_id, None)
                    combined.finished_saving.append(request_id)
                else:
                    self._saves[request_id] = count
        return combined
