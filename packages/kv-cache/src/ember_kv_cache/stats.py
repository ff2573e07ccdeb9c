"""Prefix-cache statistics, counted in tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``take_prefix_cache_stats()``.

    ``queries`` is the number of prompt tokens looked up and ``hits`` how many of them were found
    in the cache; ``requests`` counts the lookups.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries``, or 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens
