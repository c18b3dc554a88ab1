"""``GET /metrics`` of ``vxc serve``: Prometheus text exposition through ``prometheus_client`` (the library vLLM's and
TGI's servers expose theirs with).

Two kinds of figures, all prefixed ``vxc_``:

- read from the scheduler and the prefix cache at scrape time (what ``/health`` shows): slots, running and
  waiting requests, scheduler steps, prompt tokens prefilled, rows decoded, batched decode steps and the seconds
  in them and in prefill chunks, the prefix cache's bytes / budget / hits / misses / restored tokens / evictions;
- per request, recorded as requests end: requests by finish reason, prompt and completion tokens, time to first
  token and end-to-end latency (histograms, from the moment a request is queued).

Each app has a registry of its own (two apps in one process never share or clash).
"""

from __future__ import annotations

import time

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _SchedulerCollector:
    """The scheduler's and the prefix cache's own counters, read when scraped."""

    def __init__(self, served):
        self.served = served

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sch = self.served.scheduler
        st = sch.stats()
        yield GaugeMetricFamily("vxc_slots", "state slots (sequences decoded together)", value=st["slots"])
        yield GaugeMetricFamily("vxc_requests_running", "requests in slots, still running", value=st["active"])
        yield GaugeMetricFamily("vxc_requests_waiting", "requests queued for a slot", value=st["waiting"])
        yield GaugeMetricFamily("vxc_queue_capacity", "requests the queue holds (one more is a 429)",
                                value=sch.max_queue)
        for name, key, doc in (("vxc_scheduler_steps", "steps", "scheduler steps"),
                               ("vxc_prompt_tokens_prefilled", "prefilled_tokens", "prompt tokens run through the model"),
                               ("vxc_decoded_rows", "decoded_rows", "rows of batched decode steps (generated tokens fed)"),
                               ("vxc_decode_steps", "decode_steps", "batched decode steps"),
                               ("vxc_decode_seconds", "decode_seconds", "seconds in batched decode steps"),
                               ("vxc_prefill_seconds", "prefill_seconds", "seconds in prefill chunks")):
            yield CounterMetricFamily(name, doc, value=st[key])
        cache = sch.cache
        stats = cache.stats() if cache is not None and callable(getattr(cache, "stats", None)) else None
        if stats:
            for key, value in stats.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                name = f"vxc_prefix_cache_{key}"
                if key in ("bytes", "budget", "snapshots", "nodes"):
                    yield GaugeMetricFamily(name, f"prefix cache: {key}", value=value)
                else:
                    yield CounterMetricFamily(name, f"prefix cache: {key}", value=value)


class Metrics:
    def __init__(self, served):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.finished = Counter("vxc_requests", "requests (choices) ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("vxc_request_prompt_tokens", "prompt tokens of ended requests", registry=r)
        self.completion_tokens = Counter("vxc_request_completion_tokens", "tokens generated for ended requests",
                                         registry=r)
        self.ttft = Histogram("vxc_time_to_first_token_seconds", "from queued to the first token chosen",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("vxc_request_seconds", "from queued to ended", buckets=LATENCY_BUCKETS, registry=r)
        r.register(_SchedulerCollector(served))

    def first_token(self, queued: float) -> None:
        self.ttft.observe(time.perf_counter() - queued)

    def ended(self, req, queued: float, first_seen: bool) -> None:
        """A request (one choice) ended: ``req`` the scheduler's Request."""
        now = time.perf_counter()
        if req.generated and not first_seen:  # (its first token ended it: an EOS id, a stop string)
            self.ttft.observe(now - queued)
        self.latency.observe(now - queued)
        self.finished.labels(req.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(req.prompt))
        self.completion_tokens.inc(len(req.generated))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
