"""Prometheus metrics at /metrics, read with prometheus-client's own parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(api: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_requests_tokens_and_slots(api: httpx.Client) -> None:
    before = samples(api)
    model = frozenset({("model", "smollm2:latest")})  # the canonical name
    for _ in range(2):
        r = api.post("/api/chat", json={"model": "smollm2", "stream": False,
                                        "messages": [{"role": "user", "content": "Hi"}],
                                        "options": {"num_predict": 3}})
        assert r.status_code == 200
    api.get("/no/such/page")
    after = samples(api)

    def grew(name: str, labels: frozenset[tuple[str, str]]) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    ok = frozenset({("route", "/api/chat"), ("status", "200")})
    assert grew("llmrun_http_requests_total", ok) == 2
    assert grew("llmrun_http_requests_total",
                frozenset({("route", "other"), ("status", "404")})) == 1
    assert grew("llmrun_generated_tokens_total", model) == 6
    prompt = grew("llmrun_prompt_tokens_total", model)
    assert prompt > 10
    # the second identical prompt came from the prefix cache
    assert 0 < grew("llmrun_prompt_cached_tokens_total", model) < prompt
    assert grew("llmrun_request_seconds_count", model) == 2
    assert after[("llmrun_models_loaded", frozenset())] >= 1
    assert after[("llmrun_slots", model)] == 2  # the test daemon's LLMRUN_NUM_PARALLEL
    assert after[("llmrun_slots_busy", model)] == 0
