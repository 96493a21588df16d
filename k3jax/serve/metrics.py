"""The server's Prometheus metrics (`/metrics`, text exposition format).

Counters and histograms are observed as requests finish (`observe`); the gauges are read from
the engine at scrape time (`Engine.stats`), so they are never stale:

  k3jax_requests_total{endpoint, finish_reason}     finished requests (stop, length,
                                                    tool_calls, cancelled, error)
  k3jax_http_errors_total{status}                   refused requests (4xx) and failures
  k3jax_prompt_tokens_total, k3jax_generation_tokens_total, k3jax_cached_prompt_tokens_total
  k3jax_time_to_first_token_seconds                 histogram: arrival → first token
  k3jax_time_per_output_token_seconds               histogram: first → last token, per token
  k3jax_request_latency_seconds                     histogram: arrival → finish
  k3jax_queue_length, k3jax_running_requests        gauges
  k3jax_pages_{total,in_use,cached,free}            MLA pages: held by requests, by the
                                                    prefix cache only, free
  k3jax_prefix_cache_hit_rate                       cached prompt tokens / prompt tokens
  k3jax_prefix_cache_lookup_hit_rate                lookups that hit / lookups
  k3jax_prefix_cache_entries{tier}                  entries with a device / host checkpoint
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0)


class _EngineGauges:
  """A collector reading `Engine.stats()` at scrape time."""

  def __init__(self, engine):
    self.engine = engine

  def collect(self):
    st = self.engine.stats()

    def gauge(name, doc, value, labels=None):
      g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
      g.add_metric(list((labels or {}).values()), value)
      return g
    yield gauge("k3jax_queue_length", "Requests waiting for a slot", st["waiting"])
    yield gauge("k3jax_running_requests", "Requests holding a slot", st["running"])
    yield gauge("k3jax_pages_total", "MLA latent pages in the pool", st["pages_total"])
    yield gauge("k3jax_pages_in_use", "Pages held by running requests", st["pages_in_use"])
    yield gauge("k3jax_pages_cached", "Pages held by the prefix cache only", st["pages_cached"])
    yield gauge("k3jax_pages_free", "Free pages", st["pages_free"])
    yield gauge("k3jax_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens",
                st["cached_tokens"] / max(st["prompt_tokens"], 1))
    yield gauge("k3jax_prefix_cache_lookup_hit_rate", "Prefix-cache lookups that hit",
                st["cache_hits"] / max(st["cache_lookups"], 1))
    g = GaugeMetricFamily("k3jax_prefix_cache_entries", "Prefix-cache entries by checkpoint tier",
                          labels=["tier"])
    g.add_metric(["device"], st["cache_entries"] - st["cache_entries_host"])
    g.add_metric(["host"], st["cache_entries_host"])
    yield g


class Metrics:
  """One registry per server (module doc)."""

  def __init__(self, engine):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("k3jax_requests", "Finished requests",
                            ["endpoint", "finish_reason"], registry=r)
    self.errors = Counter("k3jax_http_errors", "Refused or failed requests", ["status"],
                          registry=r)
    self.prompt_tokens = Counter("k3jax_prompt_tokens", "Prompt tokens of admitted requests",
                                 registry=r)
    self.cached_tokens = Counter("k3jax_cached_prompt_tokens",
                                 "Prompt tokens read from the prefix cache", registry=r)
    self.generation_tokens = Counter("k3jax_generation_tokens", "Generated tokens",
                                     registry=r)
    self.ttft = Histogram("k3jax_time_to_first_token_seconds", "Arrival to first token",
                          buckets=_TIME_BUCKETS, registry=r)
    self.tpot = Histogram("k3jax_time_per_output_token_seconds",
                          "Time per output token after the first", buckets=_TIME_BUCKETS,
                          registry=r)
    self.latency = Histogram("k3jax_request_latency_seconds", "Arrival to finish",
                             buckets=_TIME_BUCKETS, registry=r)
    r.register(_EngineGauges(engine))

  def observe(self, endpoint: str, record, finish_reason: str) -> None:
    """A finished request (`engine.Request`)."""
    self.requests.labels(endpoint, finish_reason).inc()
    self.prompt_tokens.inc(len(record.prompt))
    self.cached_tokens.inc(record.cached_tokens)
    self.generation_tokens.inc(len(record.tokens))
    if record.first_token_at is not None:
      self.ttft.observe(record.first_token_at - record.arrived)
      if len(record.tokens) > 1 and record.finished_at is not None:
        self.tpot.observe((record.finished_at - record.first_token_at) / (len(record.tokens) - 1))
    if record.finished_at is not None:
      self.latency.observe(record.finished_at - record.arrived)

  def render(self) -> bytes:
    return generate_latest(self.registry)


__all__ = ["Metrics", "CONTENT_TYPE"]
