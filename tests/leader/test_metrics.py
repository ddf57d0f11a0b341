"""EngineMetrics: Prometheus exposition per engine, and the periodic stats line."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from nvllm.leader.metrics import EngineMetrics


def samples(m: EngineMetrics) -> dict[str, float]:
    return {s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(m.exposition()) for s in f.samples}


def test_two_engines_do_not_share_counters():
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.record_step(prompt_tokens=10, generation_tokens=3, preemptions=1, queries=10, hits=4)
    sa, sb = samples(a), samples(b)
    key = "nvllm:prompt_tokens_total[('model_name', 'a')]"
    assert sa[key] == 10
    assert sb["nvllm:prompt_tokens_total[('model_name', 'b')]"] == 0


def test_stats_line_every_interval(caplog):
    m = EngineMetrics("m", log_interval_s=0.0)
    m.record_step(prompt_tokens=100, generation_tokens=20, preemptions=2, queries=100, hits=25)
    with caplog.at_level(logging.INFO, logger="nvllm.leader.stats"):
        m.maybe_log(running=3, waiting=1, kv_usage=0.5)
    line = caplog.records[-1].getMessage()
    assert "Running: 3 reqs, Waiting: 1 reqs" in line
    assert "KV cache usage: 50.0%" in line and "Prefix cache hit rate: 25.0%" in line
    assert "Preemptions: 2" in line and "Avg generation throughput" in line
    # Counts restart after each line.
    with caplog.at_level(logging.INFO, logger="nvllm.leader.stats"):
        m.maybe_log(running=0, waiting=0, kv_usage=0.0)
    assert "Preemptions: 0" in caplog.records[-1].getMessage()


def test_no_line_before_the_interval(caplog):
    m = EngineMetrics("m", log_interval_s=3600.0)
    with caplog.at_level(logging.INFO, logger="nvllm.leader.stats"):
        m.maybe_log(running=1, waiting=0, kv_usage=0.1)
    assert not caplog.records
