"""Prometheus metrics of one engine, with vLLM's metric names under ``ember:``.

Each ``EngineMetrics`` owns its own ``CollectorRegistry`` (several engines can live in one
process, as in tests); the HTTP app serves it with ``render()``. The front end feeds it: request
latencies and token counts from its output processing (``IterationStats``), gauges and counters
from the engine core's ``SchedulerStats``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ember_kv_cache import KVConnectorStats
from ember_scheduler.engine_types import SchedulerStats, SpecDecodingStats
from ember_server.engine.lora_metrics import LoRAMetrics

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip


@dataclasses.dataclass
class IterationStats:
    """What the front end saw while processing one batch of engine outputs."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    e2e_latencies: list[float] = dataclasses.field(default_factory=list)
    finished_reasons: list[str] = dataclasses.field(default_factory=list)


class SpecDecodingLog:
    """Logs the mean acceptance length and per-position acceptance every ``interval`` seconds
    (at the first stats after it elapsed), over the drafts verified since the last line."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._since = time.monotonic()
        self._totals = SpecDecodingStats()

    def record(self, stats: SpecDecodingStats) -> None:
        totals = self._totals
        totals.num_drafts += stats.num_drafts
        totals.num_draft_tokens += stats.num_draft_tokens
        totals.num_accepted_tokens += stats.num_accepted_tokens
        per_pos = totals.num_accepted_tokens_per_pos
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            if position == len(per_pos):
                per_pos.append(0)
            per_pos[position] += count
        now = time.monotonic()
        if now - self._since >= self.interval and totals.num_drafts:
            logger.info("%s", self.summary())
            self._since = now
            self._totals = SpecDecodingStats()

    def summary(self) -> str:
        t = self._totals
        # Each verified run emits its accepted drafts plus one token of the target's own.
        mean_length = 1 + t.num_accepted_tokens / max(t.num_drafts, 1)
        per_pos = ", ".join(
            f"{count / max(t.num_drafts, 1):.2f}" for count in t.num_accepted_tokens_per_pos
        )
        return (
            f"speculative decoding: mean acceptance length {mean_length:.2f}, "
            f"{t.num_accepted_tokens} of {t.num_draft_tokens} draft tokens accepted "
            f"({t.num_accepted_tokens / max(t.num_draft_tokens, 1):.1%}) over {t.num_drafts} "
            f"drafts; acceptance by position: {per_pos}"
        )


class EngineMetrics:
    """The ``ember:*`` collectors of one engine, labelled with its served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("ember:num_requests_running", "Requests in the batch.")
        self.num_requests_waiting = gauge("ember:num_requests_waiting", "Requests waiting.")
        self.kv_cache_usage_perc = gauge(
            "ember:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all)."
        )
        self.prefix_cache_queries = counter(
            "ember:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "ember:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("ember:num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("ember:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("ember:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "ember:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "ember:inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "ember:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            _REQUEST_BUCKETS,
        )
        self.spec_decode_num_drafts = counter(
            "ember:spec_decode_num_drafts", "Requests' draft runs verified."
        )
        self.spec_decode_num_draft_tokens = counter(
            "ember:spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "ember:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_decode_accepted_per_pos = Counter(
            "ember:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft run (0 = first).",
            ["model_name", "position"],
            registry=r,
        )
        self.spec_decode_log = SpecDecodingLog()
        self._request_success = Counter(
            "ember:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._engine_alive = Gauge(
            "ember:engine_core_alive",
            "1 while the engine core (by data-parallel index) serves, 0 once it is dead.",
            ["model_name", "engine"],
            registry=r,
        )
        self._engine_restarts = Counter(
            "ember:engine_core_restarts",
            "Times the engine core (by data-parallel index) was restarted after it died.",
            ["model_name", "engine"],
            registry=r,
        )
        self._routed_requests = Counter(
            "ember:dp_routed_requests",
            "Requests sent to each engine core, by why: prefix (it held the prompt's prefix) "
            "or load (the least loaded).",
            ["model_name", "engine", "reason"],
            registry=r,
        )
        self._model_name = model_name
        self._kv_connector = _KVConnectorMetrics(r, model_name)
        self._lora = LoRAMetrics(r, model_name)

    def record_scheduler_stats(
        self, stats: SchedulerStats, gauges: SchedulerStats | None = None
    ) -> None:
        """Count ``stats`` (one engine's step); set the gauges from ``gauges`` (every engine's
        latest, summed) or else from ``stats``."""
        gauges = stats if gauges is None else gauges
        self.num_requests_running.set(gauges.num_running_reqs)
        self.num_requests_waiting.set(gauges.num_waiting_reqs)
        self.kv_cache_usage_perc.set(gauges.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        if stats.kv_connector_stats is not None:
            self._kv_connector.record(stats.kv_connector_stats)
        if stats.lora is not None:
            self._lora.record(stats.lora)
        spec = stats.spec_decoding
        if spec is not None:
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                self._spec_decode_accepted_per_pos.labels(self._model_name, str(position)).inc(
                    count
                )
            self.spec_decode_log.record(spec)

    def clear_engine_gauges(self) -> None:
        """Zero the gauges the engine core reports, once it is gone and holds nothing."""
        for gauge in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage_perc,
        ):
            gauge.set(0)

    def record_iteration(self, stats: IterationStats) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens:
            self.time_to_first_token.observe(value)
        for value in stats.inter_token_latencies:
            self.inter_token_latency.observe(value)
        for value in stats.e2e_latencies:
            self.e2e_request_latency.observe(value)
        for reason in stats.finished_reasons:
            self._request_success.labels(self._model_name, reason).inc()

    def record_engine_alive(self, engine: int, alive: bool) -> None:
        self._engine_alive.labels(self._model_name, str(engine)).set(int(alive))

    def record_engine_restart(self, engine: int) -> None:
        self._engine_restarts.labels(self._model_name, str(engine)).inc()

    def record_route(self, engine: int, reason: str) -> None:
        self._routed_requests.labels(self._model_name, str(engine), reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector (serve with ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class _KVConnectorMetrics:
    """The KV connector's lookups, and each tier's traffic, labelled by ``tier``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name", "tier"]
        self._model_name = model_name

        def counter(name, doc):
            return Counter(name, doc, labels, registry=registry)

        self.lookup_tokens = Counter(
            "ember:kv_connector_lookup_tokens",
            "Prompt tokens past the local prefix hit looked up in the KV tiers.",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.matched_tokens = Counter(
            "ember:kv_connector_matched_tokens",
            "Of those, tokens found in the KV tiers.",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.loaded_tokens = Counter(
            "ember:kv_connector_loaded_tokens",
            "Tokens loaded from the KV tiers into the KV cache (not computed).",
            ["model_name"],
            registry=registry,
        ).labels(model_name)
        self.queries = counter("ember:kv_tier_queries", "KV chunks looked up in the tier.")
        self.hits = counter("ember:kv_tier_hits", "KV chunks found (and valid) in the tier.")
        self.bytes_loaded = counter("ember:kv_tier_bytes_loaded", "Bytes read from the tier.")
        self.bytes_stored = counter("ember:kv_tier_bytes_stored", "Bytes written to the tier.")
        self.invalid_entries = counter(
            "ember:kv_tier_invalid_entries", "Damaged or foreign entries dropped (misses)."
        )
        self.errors = counter("ember:kv_tier_errors", "Failures of the tier's backend (misses).")
        self.load_seconds = Histogram(
            "ember:kv_tier_load_seconds", "Time to read one KV chunk.", labels,
            buckets=_TRANSFER_BUCKETS, registry=registry,
        )  # fmt: skip
        self.store_seconds = Histogram(
            "ember:kv_tier_store_seconds", "Time to write one KV chunk.", labels,
            buckets=_TRANSFER_BUCKETS, registry=registry,
        )  # fmt: skip

    def record(self, stats: KVConnectorStats) -> None:
        self.lookup_tokens.inc(stats.lookup_tokens)
        self.matched_tokens.inc(stats.matched_tokens)
        self.loaded_tokens.inc(stats.loaded_tokens)
        for tier, tier_stats in stats.tiers.items():
            labels = (self._model_name, tier)
            for name in ("queries", "hits", "bytes_loaded", "bytes_stored", "invalid_entries",
                         "errors"):  # fmt: skip
                getattr(self, name).labels(*labels).inc(getattr(tier_stats, name))
            for value in tier_stats.load_seconds:
                self.load_seconds.labels(*labels).observe(value)
            for value in tier_stats.store_seconds:
                self.store_seconds.labels(*labels).observe(value)
