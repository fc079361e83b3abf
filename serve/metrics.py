"""Prometheus metrics named like vLLM's, with the ``mlc_spec:`` prefix for ``vllm:``, so
dashboards built for vLLM read the same figures. Observed on the engine thread."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mlc_spec.runtime.engine import Occupancy
from mlc_spec.runtime.metrics import SpecStats

# vLLM's bucket edges.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_DRAFT_LENGTH = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


class ServerMetrics:
    """One registry per server, so several servers can live in one process (tests)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"mlc_spec:{name}", doc, **label).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"mlc_spec:{name}", doc, **label).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"mlc_spec:{name}", doc, buckets=buckets, **label).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests admitted to a batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full)."
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Per request: time after the first token / tokens after the first.",
            _TPOT,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _E2E
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache as sequences entered."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Tokens found in the prefix cache (their K/V reused)."
        )
        self._prefix_seen = (0, 0)
        self.suffix_cache_bytes = gauge(
            "suffix_cache_bytes", "Bytes of earlier outputs held for suffix decoding."
        )
        self.suffix_cache_evictions = counter(
            "suffix_cache_evictions", "Earlier outputs evicted from the suffix decoding cache."
        )
        self._evictions_seen = 0
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            "mlc_spec:request_success",
            "Finished samples (n per request) by finish reason: stop, length or abort.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self._num_drafts = counter("spec_decode_num_drafts", "Verification steps with drafts.")
        self._num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self._num_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = Counter(
            "mlc_spec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.draft_length = histogram(
            "spec_decode_draft_length",
            "Draft tokens chosen per sequence and step (0: that step did not speculate).",
            _DRAFT_LENGTH,
        )
        self._spec_seen = SpecStats()

    def finished(self, reason: str) -> None:
        self._request_success.labels(self._model_name, reason).inc()

    def observe_engine(self, occupancy: Occupancy, stats: SpecStats, proposer: dict) -> None:
        """Load gauges now, and the engine-wide counters' growth since last time; ``proposer``
        is what the proposer reports (``Proposer.metrics``)."""
        suffix = proposer.get("suffix_cache")
        if suffix is not None:
            self.suffix_cache_bytes.set(suffix["bytes"])
            self.suffix_cache_evictions.inc(suffix["evictions"] - self._evictions_seen)
            self._evictions_seen = suffix["evictions"]
        queries, hits = occupancy.prefix_cache_queries, occupancy.prefix_cache_hits
        self.prefix_cache_queries.inc(queries - self._prefix_seen[0])
        self.prefix_cache_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self.num_requests_running.set(occupancy.num_running)
        self.num_requests_waiting.set(occupancy.num_waiting)
        used = occupancy.capacity_pages - occupancy.free_pages
        self.kv_cache_usage_perc.set(used / occupancy.capacity_pages)
        seen = self._spec_seen
        self._num_drafts.inc(stats.num_drafts - seen.num_drafts)
        self._num_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self._num_accepted.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, count in enumerate(stats.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if count > before:
                self._accepted_per_pos.labels(self._model_name, str(pos)).inc(count - before)
        self._spec_seen = SpecStats()
        self._spec_seen.merge(stats)
