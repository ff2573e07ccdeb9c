"""Speculative decoding counters on /metrics and the periodic acceptance log line."""

from __future__ import annotations

import logging

from ember_scheduler.engine_types import SchedulerStats, SpecDecodingStats
from ember_server.engine.metrics import EngineMetrics


def stats(drafts, draft_tokens, accepted, per_pos):
    spec = SpecDecodingStats(drafts, draft_tokens, accepted, per_pos)
    return SchedulerStats(spec_decoding=spec)


def test_counters_and_per_position_acceptance_are_exported():
    metrics = EngineMetrics("m")
    metrics.record_scheduler_stats(stats(2, 8, 5, [2, 2, 1]))
    metrics.record_scheduler_stats(stats(1, 4, 4, [1, 1, 1, 1]))
    text = metrics.render().decode()
    assert 'ember:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'ember:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'ember:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    per_pos = "ember:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="m",position="0"}} 3.0' in text
    assert f'{per_pos}{{model_name="m",position="3"}} 1.0' in text


def test_the_log_line_gives_the_mean_acceptance_length(caplog):
    metrics = EngineMetrics("m")
    metrics.spec_decode_log.interval = 0.0
    with caplog.at_level(logging.INFO, logger="ember_server.engine.metrics"):
        metrics.record_scheduler_stats(stats(4, 16, 6, [3, 2, 1, 0]))
    # 6 accepted over 4 runs, plus each run's own token: 2.5 tokens per verified run
    assert "mean acceptance length 2.50" in caplog.text
    assert "6 of 16 draft tokens accepted (37.5%)" in caplog.text
    assert "acceptance by position: 0.75, 0.50, 0.25, 0.00" in caplog.text
    metrics.record_scheduler_stats(SchedulerStats())  # no drafting: no line
    assert caplog.text.count("mean acceptance length") == 1
