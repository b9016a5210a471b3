"""The `tts_*` metrics and their Prometheus text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tts_service.serve.metrics import Metrics


def _samples(m: Metrics) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(m.text().decode())
        for s in family.samples
    }


def test_a_request_counts_its_status_tokens_duration_and_trajectories():
    m = Metrics()
    usage = {"prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27}
    m.record("chat", 200, 0.3, usage, [1.5, 2.5])
    m.record("chat", 200, 0.2, usage, [1.0])
    m.record("solve", 400, 0.01)
    m.report_depth("r", 1, 2)
    m.report_depth("r", 2, 1)
    s = _samples(m)
    assert s[("tts_requests_total", (("route", "chat"), ("status", "200")))] == 2
    assert s[("tts_requests_total", (("route", "solve"), ("status", "400")))] == 1
    assert s[("tts_prompt_tokens_total", (("route", "chat"),))] == 14
    assert s[("tts_generation_tokens_total", (("route", "chat"),))] == 40
    assert ("tts_generation_tokens_total", (("route", "solve"),)) not in s  # no usage
    assert s[("tts_request_seconds_count", (("route", "chat"),))] == 2
    assert abs(s[("tts_request_seconds_sum", (("route", "chat"),))] - 0.5) < 1e-9
    assert s[("tts_acceptance_length_count", ())] == 3
    assert s[("tts_queue_depth", ())] == 1


def test_each_metrics_has_its_own_registry():
    """Two hubs (two apps) in one process do not share or collide."""
    a, b = Metrics(), Metrics()
    a.record("chat", 200, 0.1)
    assert ("tts_requests_total", (("route", "chat"), ("status", "200"))) not in _samples(b)


def test_the_queue_depth_is_the_replicas_latest_reports_and_never_drifts():
    """Absolute reports per replica: one lost or late changes nothing once a later one
    arrives, and the depth is never negative (delta reports drifted to -2 as clients left)."""
    m = Metrics()

    def depth() -> float:
        return _samples(m)[("tts_queue_depth", ())]

    m.report_depth("a", 1, 1)
    m.report_depth("b", 1, 2)
    m.report_depth("a", 3, 0)  # report 2 (depth 2) lost
    assert depth() == 2
    m.report_depth("a", 2, 2)  # late: older than the one held
    assert depth() == 2
    m.report_depth("b", 2, 0)
    assert depth() == 0
    m.report_depth("b", 3, -1)
    assert depth() == 0
