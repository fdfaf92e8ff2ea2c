"""Prometheus metrics at /metrics, read with prometheus-client's own parser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Daemon, make_home


def samples(api: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = api.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_requests_tokens_and_slots(api: httpx.Client) -> None:
    # The shared daemon may hold SmolLM2's weights loaded under another name that a test
    # left (a copy or a created variant): the slots below are those of a runner loaded as
    # smollm2, so begin with nothing loaded
    for m in api.get("/api/ps").json()["models"]:
        api.post("/api/generate", json={"model": m["name"], "keep_alive": 0})
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
    # the engine's steps: at least one per generated token, and the prompts read in them
    # (the cached part of the second prompt is not read again)
    assert grew("llmrun_engine_steps_total", model) >= 6
    assert grew("llmrun_engine_step_seconds_total", model) > 0
    assert 0 < grew("llmrun_engine_prompt_tokens_total", model) <= prompt
    assert after[("llmrun_engine_step_seconds_max", model)] >= 0


def grown(before: dict[tuple[str, frozenset[tuple[str, str]]], float],
          after: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """How much the samples named `name` whose labels include `labels` grew, together."""
    def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> float:
        return sum(v for (n, ls), v in samples.items()
                   if n == name and set(labels.items()) <= ls)
    return total(after) - total(before)


def stream_hi(an: Any) -> Any:
    """One streamed request through the official anthropic SDK; its final message."""
    with an.messages.stream(model="smollm2", max_tokens=4, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": "Hi"}]) as stream:
        assert "".join(stream.text_stream)
        return stream.get_final_message()


def test_a_streamed_anthropic_request_is_one_lease_and_one_runner_request(
        api: httpx.Client, an: Any) -> None:
    """One trip: message_start's input_tokens comes from the runner's first event, not from
    a count beforehand (a second lease and IPC round trip, the prompt rendered twice)."""
    before = samples(api)
    final = stream_hi(an)
    after = samples(api)
    model = {"model": "smollm2:latest"}
    assert grown(before, after, "llmrun_model_leases_total", **model) == 1
    assert grown(before, after, "llmrun_runner_requests_total", **model) == 1
    assert grown(before, after, "llmrun_runner_requests_total", kind="generate", **model) == 1
    assert final.usage.output_tokens == 4


def test_with_keep_alive_0_a_streamed_anthropic_request_loads_the_model_once(
        tmp_path: Path, smollm2_path: Path) -> None:
    """With LLMRUN_KEEP_ALIVE=0 each lease ends in an unload: two trips were two loads."""
    import anthropic

    home = make_home(tmp_path, smollm2_path)
    d = Daemon(home, env={"LLMRUN_KEEP_ALIVE": "0"}).start()
    try:
        with anthropic.Anthropic(base_url=d.url, api_key="x", max_retries=0,
                                 timeout=120) as an, \
                httpx.Client(base_url=d.url, timeout=120) as api:
            final = stream_hi(an)
            after = samples(api)
    finally:
        d.stop()
    # every runner logs one line when its model is loaded, before it reports ready
    loads = sum(log.read_text().count(" runner INFO loaded ")
                for log in (home / "logs").glob("runner-*.log"))
    assert loads == 1
    assert grown({}, after, "llmrun_model_leases_total") == 1
    assert grown({}, after, "llmrun_runner_requests_total") == 1
    assert final.usage.output_tokens == 4


def test_device_memory_and_each_models_share_come_from_the_cached_list() -> None:
    """No daemon: the gauges read the device list and the scheduler's snapshots as given."""
    from types import SimpleNamespace

    from llmrun.server.fit import Device
    from llmrun.server.metrics import Metrics

    listed = [Device("CPU", "cpu", 64 << 30, 32 << 30, "AMD EPYC"),
              Device("Vulkan0", "gpu", 8 << 30, 6 << 30, "Radeon")]
    model = SimpleNamespace(name="m:latest", slots_busy=0, slots=1, engine={},
                            devices={"CPU": 100 << 20, "Vulkan0": 900 << 20})
    scheduler: Any = SimpleNamespace(models=lambda: [model])
    metrics = Metrics(scheduler, lambda: listed)
    got = {(s.name, frozenset(s.labels.items())): s.value
           for f in text_string_to_metric_families(metrics.render().decode())
           for s in f.samples}

    def memory(device: str, kind: str) -> float:
        return got[("llmrun_device_memory_bytes",
                    frozenset({("device", device), ("kind", kind)}))]

    assert memory("Vulkan0", "total") == 8 << 30 and memory("Vulkan0", "free") == 6 << 30
    assert memory("CPU", "total") == 64 << 30 and memory("CPU", "free") == 32 << 30
    held = {dict(ls)["device"]: v for (n, ls), v in got.items()
            if n == "llmrun_model_device_bytes" and ("model", "m:latest") in ls}
    assert held == {"CPU": 100 << 20, "Vulkan0": 900 << 20}
    # without a device list (or before the first listing) there are no device samples
    bare = Metrics(scheduler).render().decode()
    assert "llmrun_device_memory_bytes{" not in bare
