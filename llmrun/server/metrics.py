"""Prometheus metrics at `/metrics` (prometheus-client's text format).

What an operator watches on a shared daemon: requests by route and status (503s are the
queue overflowing), tokens read and generated per model and how many of the prompt tokens
came from the prefix cache, how long prompts and answers take, and, read at scrape time,
which models are loaded and how many of their slots are busy, and the memory of each device
llama.cpp lists and what each loaded model holds on it. Leases and runner requests
show the trips a request makes: one of each per generated answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _render
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import Message, Scope

from llmrun.request import Stats
from llmrun.server.fit import Device
from llmrun.server.scheduler import Scheduler

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _Loaded(Collector):
    """Gauges read from the scheduler when scraped."""

    def __init__(self, scheduler: Scheduler,
                 devices: Callable[[], list[Device]] | None = None) -> None:
        self.scheduler = scheduler
        self.devices = devices  # the daemon's cached list: a scrape never lists them again

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loaded = GaugeMetricFamily("llmrun_models_loaded", "Models loaded in memory")
        busy = GaugeMetricFamily("llmrun_slots_busy", "Requests a model is serving now",
                                 labels=["model"])
        slots = GaugeMetricFamily("llmrun_slots", "Sequences a model decodes together",
                                  labels=["model"])
        # the engine's steps (stall-free batching): counters since the runner started
        steps = CounterMetricFamily("llmrun_engine_steps", "Engine steps (one batched decode "
                                    "each)", labels=["model"])
        step_seconds = CounterMetricFamily("llmrun_engine_step_seconds", "Time in engine "
                                           "steps", labels=["model"])
        mixed = CounterMetricFamily("llmrun_engine_mixed_steps", "Steps that read a prompt "
                                    "beside generating sequences", labels=["model"])
        prompt = CounterMetricFamily("llmrun_engine_prompt_tokens", "Prompt tokens read in "
                                     "steps", labels=["model"])
        longest = GaugeMetricFamily("llmrun_engine_step_seconds_max", "The longest step in "
                                    "the last second the engine reported", labels=["model"])
        budget = GaugeMetricFamily("llmrun_engine_prompt_budget_tokens", "Prompt tokens a "
                                   "step may read beside generating sequences "
                                   "(LLMRUN_STEP_BUDGET, as last measured)", labels=["model"])
        memory = GaugeMetricFamily("llmrun_device_memory_bytes", "Memory of each device "
                                   "llama.cpp lists, total and free (free as last listed: at "
                                   "start, and before each load where there are GPUs)",
                                   labels=["device", "kind"])
        held = GaugeMetricFamily("llmrun_model_device_bytes", "Bytes a loaded model holds on "
                                 "each device (the host as CPU): measured by the runner, else "
                                 "estimated", labels=["model", "device"])
        for d in self.devices() if self.devices is not None else []:
            memory.add_metric([d.name, "total"], d.total)
            memory.add_metric([d.name, "free"], d.free)
        models = self.scheduler.models()
        loaded.add_metric([], len(models))
        for m in models:
            for device, size in m.devices.items():
                held.add_metric([m.name, device], size)
            busy.add_metric([m.name], m.slots_busy)
            slots.add_metric([m.name], m.slots)
            e = m.engine
            if e:
                steps.add_metric([m.name], e.get("steps", 0))
                step_seconds.add_metric([m.name], e.get("step_seconds", 0.0))
                mixed.add_metric([m.name], e.get("mixed_steps", 0))
                prompt.add_metric([m.name], e.get("prompt_tokens", 0))
                longest.add_metric([m.name], e.get("step_seconds_max", 0.0))
                budget.add_metric([m.name], e.get("budget_tokens", 0))
        yield from (loaded, busy, slots, steps, step_seconds, mixed, prompt, longest, budget,
                    memory, held)


class Metrics:
    def __init__(self, scheduler: Scheduler,
                 devices: Callable[[], list[Device]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmrun_http_requests", "HTTP requests answered",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("llmrun_prompt_tokens", "Prompt tokens of finished "
                                     "requests", ["model"], registry=r)
        self.cached_tokens = Counter("llmrun_prompt_cached_tokens", "Prompt tokens that came "
                                     "from the prefix cache", ["model"], registry=r)
        self.generated_tokens = Counter("llmrun_generated_tokens", "Tokens generated",
                                        ["model"], registry=r)
        self.draft_tokens = Counter("llmrun_draft_tokens", "Tokens guessed ahead by prompt "
                                    "lookup and checked in the same decode", ["model"],
                                    registry=r)
        self.draft_accepted = Counter("llmrun_draft_accepted_tokens", "Guessed tokens that "
                                      "came true", ["model"], registry=r)
        self.prompt_seconds = Histogram("llmrun_prompt_seconds", "Time to read a prompt "
                                        "(to the first token)", ["model"], buckets=_SECONDS,
                                        registry=r)
        self.request_seconds = Histogram("llmrun_request_seconds", "Time from request to "
                                         "last token", ["model"], buckets=_SECONDS, registry=r)
        self.leases = Counter("llmrun_model_leases", "Times a request held a model through "
                              "the scheduler", ["model"], registry=r)
        self.runner_requests = Counter("llmrun_runner_requests", "Requests the daemon sent to "
                                       "runner processes (generate, count, embed)",
                                       ["model", "kind"], registry=r)
        r.register(_Loaded(scheduler, devices))

    def observe(self, model: str, s: Stats) -> None:
        self.prompt_tokens.labels(model).inc(s.prompt_tokens)
        self.cached_tokens.labels(model).inc(min(s.cached_tokens, s.prompt_tokens))
        self.generated_tokens.labels(model).inc(s.completion_tokens)
        self.draft_tokens.labels(model).inc(s.draft_tokens)
        self.draft_accepted.labels(model).inc(s.draft_accepted)
        self.prompt_seconds.labels(model).observe(s.prompt_ns / 1e9)
        self.request_seconds.labels(model).observe(s.total_ns / 1e9)

    def count_response(self, scope: Scope, message: Message) -> None:
        """Count an HTTP response by route and status. The route is the matched route's
        template (`/api/blobs/{digest}`), which routing leaves in the scope; anything
        unmatched is "other", so a scan of random URLs adds no labels."""
        route = getattr(scope.get("route"), "path", None) or "other"
        self.requests.labels(route, str(message["status"])).inc()

    def render(self) -> bytes:
        return _render(self.registry)
