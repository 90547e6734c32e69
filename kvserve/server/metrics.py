"""Prometheus metrics under vLLM's names with the `kvserve:` prefix and a model_name label.

Gauges and counters are read from LLMEngine.get_metrics() at scrape time (the same numbers
LLM.get_metrics() gives); histograms are observed once per finished request by the engine
thread (AsyncEngine's on_finished hook). Each app has its own CollectorRegistry.
`kvserve serve --metrics-names vllm` also exports the metrics vLLM has under their `vllm:` names
(VLLM_NAMES), so dashboards built for vLLM read kvserve too.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvserve.engine.async_engine import FinishedRequest

PREFIX = "kvserve:"
VLLM_PREFIX = "vllm:"
# kvserve name -> its vLLM names: vLLM v1's, then the older ones dashboards still query
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "num_requests_swapped": ("num_requests_swapped",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}

# (name, help, key in get_metrics()) — gauges read at scrape time
GAUGES = [
    ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).", "num_requests_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV blocks owned by a request (0-1).", "kv_cache_usage"),
    ("num_blocks_total", "KV blocks in the pool.", "num_blocks_total"),
    ("num_blocks_free", "KV blocks no request owns (cached ones included).", "num_blocks_free"),
    ("num_blocks_cached", "KV blocks registered in the prefix cache (owned or free).", "num_blocks_cached"),
    ("swap_usage_bytes", "Bytes of KV held in the CPU swap tier.", "swap_usage_bytes"),
    ("num_requests_swapped", "Preempted requests whose KV sits in the swap space.", "num_requests_swapped"),
    ("kv_requests_evicting", "Requests running under a KV eviction policy.", "kv_requests_evicting"),
    ("kv_pinned_blocks", "KV blocks pinned by a request's kv_retention (owned or free).", "kv_pinned_blocks"),
    ("kv_pin_limit_blocks", "Most KV blocks retention pins may hold (kv_pin_fraction of the pool).",
     "kv_pin_limit_blocks"),
]
# counters; exposed with a _total suffix
COUNTERS = [
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
    ("prompt_tokens_cached", "Prompt tokens of admitted requests served from the prefix cache "
     "(usage.prompt_tokens_details.cached_tokens).", "prompt_tokens_cached"),
    ("num_preemptions", "Requests preempted to free KV blocks.", "num_preemptions"),
    ("num_swapped_out_blocks", "KV blocks copied to the swap space.", "num_swapped_out_blocks"),
    ("num_swapped_in_blocks", "KV blocks copied back from the swap space.", "num_swapped_in_blocks"),
    ("prompt_tokens", "Prompt tokens received.", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
    ("kv_evicted_tokens", "Tokens dropped by KV eviction policies (per evicting layer).", "kv_evicted_tokens"),
    ("kv_eviction_blocks_freed", "KV blocks given back to the pool by eviction.", "kv_eviction_blocks_freed"),
    ("kv_pins_taken", "KV blocks newly pinned by kv_retention.", "kv_pins_taken"),
    ("kv_pins_refused", "KV block pins refused because the pin share was full.", "kv_pins_refused"),
    ("kv_pins_expired", "KV block pins that reached their ttl.", "kv_pins_expired"),
    ("kv_pins_evicted", "Pinned free KV blocks reused because no unpinned block was free.", "kv_pins_evicted"),
    ("spec_decode_num_drafts", "Speculative decoding: request steps that verified proposed tokens.",
     "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
     "spec_decode_num_accepted_tokens"),
    ("kv_poisoned_blocks_evicted", "Device KV blocks evicted from the prefix cache because a request that read or "
     "wrote them got NaN or infinite logits.", "kv_poisoned_blocks_evicted"),
    ("kv_poisoned_prefix_failures", "Requests failed with NaN or infinite logits after reading a cached prefix "
     "(the prefix is evicted).", "kv_poisoned_prefix_failures"),
]

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... below max_model_len, then max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= max_model_len:
                return out + [float(max_model_len)]
            out.append(float(m * scale))
        scale *= 10


class _EngineCollector(Collector):
    """Gauges and counters from the latest engine metrics snapshot."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict = {}
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            snap = dict(self.snapshot)
        label = [self.model_name]
        for name, doc, key in GAUGES:
            if key in snap and snap[key] is not None:
                g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
                g.add_metric(label, float(snap[key]))
                yield g
        for name, doc, key in COUNTERS:
            if key in snap:
                c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
                c.add_metric(label, float(snap[key]))
                yield c
        yield from _tier_families(snap, self.model_name)
        yield from _transfer_families(snap, self.model_name)
        yield from _block_time_families(snap, self.model_name)
        yield from _spec_families(snap, self.model_name)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished sequences by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(snap.get("request_success", {}).items()):
            success.add_metric([self.model_name, reason], float(count))
        yield success


def _spec_families(snap: dict, model_name: str):
    """Accepted proposals by their position among a step's proposals (speculative decoding)."""
    per_pos = snap.get("spec_decode_num_accepted_tokens_per_pos")
    if per_pos is None:
        return
    c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                            "Speculative decoding: proposed tokens accepted, by their position (0: the first).",
                            labels=["model_name", "position"])
    for pos, n in enumerate(per_pos):
        c.add_metric([model_name, str(pos)], float(n))
    yield c


# per-tier counters (label tier=cpu|disk|redis) from get_metrics()["kv_tiers"]; exposed with _total
TIER_COUNTERS = [
    ("kv_tier_hits", "Blocks loaded from a KV tier.", "hits"),
    ("kv_tier_misses", "Block lookups a KV tier could not answer.", "misses"),
    ("kv_tier_read_bytes", "Bytes read from a KV tier.", "bytes_read"),
    ("kv_tier_written_bytes", "Bytes written to a KV tier.", "bytes_written"),
    ("kv_tier_errors", "I/O, connection and corrupt-entry errors of a KV tier.", "errors"),
    ("kv_tier_corrupt_entries", "Entries of a KV tier that failed verification and were dropped.", "corrupt"),
    ("kv_tier_refused_entries", "Entries of a KV tier whose seal this engine does not accept (unsigned, or "
     "signed under another tier key); never served.", "refused"),
    ("kv_tier_poisoned_entries", "Entries deleted from a KV tier because a request failed on their block.",
     "poisoned"),
    ("kv_tier_write_errors", "Entries a KV tier could not store (I/O errors).", "write_errors"),
    ("kv_tier_written_entries", "Blocks written to a KV tier.", "entries_written"),
    ("kv_tier_write_drops", "Blocks a KV tier's full write-through queue dropped.", "write_drops"),
    ("kv_tier_flush_seconds", "Seconds spent waiting for a KV tier's pending write-through writes.",
     "flush_seconds"),
]


# (name, help, key in get_metrics()["kv_transfer"]) — the KV connector's counters
TRANSFER_COUNTERS = [
    ("kv_transfer_saved_requests", "KV connector: finished prefills whose blocks were saved for a consumer.",
     "saved_requests"),
    ("kv_transfer_saved_blocks", "KV connector: blocks saved for consumers.", "saved_blocks"),
    ("kv_transfer_saved_bytes", "KV connector: bytes of blocks saved for consumers.", "saved_bytes"),
    ("kv_transfer_received_requests", "KV connector: requests whose blocks were asked of a producer.",
     "received_requests"),
    ("kv_transfer_received_blocks", "KV connector: blocks received from producers.", "received_blocks"),
    ("kv_transfer_received_bytes", "KV connector: bytes of blocks received from producers.", "received_bytes"),
    ("kv_transfer_missing_blocks", "KV connector: blocks asked for that did not arrive (recomputed).",
     "missing_blocks"),
    ("kv_transfer_load_failures", "KV connector: receives that failed (producer gone, timeout).", "load_failures"),
    ("kv_transfer_receive_seconds", "KV connector: seconds spent receiving blocks.", "receive_seconds"),
]


def _transfer_families(snap: dict, model_name: str):
    """The KV connector's counters (only on an engine with kv_transfer_config)."""
    transfer = snap.get("kv_transfer") or {}
    for name, doc, key in TRANSFER_COUNTERS if transfer else ():
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([model_name], float(transfer.get(key, 0)))
        yield c


def _tier_families(snap: dict, model_name: str):
    """Prefix-cache hits by source and per-tier counters and usage."""
    by_source = snap.get("prefix_cache_hits_by_source") or {}
    if by_source:
        c = CounterMetricFamily(PREFIX + "prefix_cache_hits_by_source",
                                "Prompt tokens served from the prefix cache, by where the blocks came from.",
                                labels=["model_name", "source"])
        for source, n in sorted(by_source.items()):
            c.add_metric([model_name, source], float(n))
        yield c
    tiers = snap.get("kv_tiers") or {}
    if not tiers:
        return
    for name, doc, key in TIER_COUNTERS:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "tier"])
        for tier, stats in sorted(tiers.items()):
            c.add_metric([model_name, tier], float(stats.get(key, 0)))
        yield c
    g = GaugeMetricFamily(PREFIX + "kv_tier_usage_bytes", "Bytes a KV tier holds (where it knows).",
                          labels=["model_name", "tier"])
    for tier, stats in sorted(tiers.items()):
        if stats.get("usage_bytes") is not None:
            g.add_metric([model_name, tier], float(stats["usage_bytes"]))
    yield g
    g = GaugeMetricFamily(PREFIX + "kv_tier_pending_writes", "Blocks queued for a write-through KV tier.",
                          labels=["model_name", "tier"])
    for tier, stats in sorted(tiers.items()):
        g.add_metric([model_name, tier], float(stats.get("pending_writes", 0)))
    yield g


# block timings from get_metrics() (kv/block_stats.py snapshots), observed by the block pool
BLOCK_HISTOGRAMS = [
    ("kv_block_lifetime_seconds", "KV block lifetime: allocation until its contents are dropped "
     "(freed without a prefix hash, or evicted from the prefix cache).", "kv_block_lifetime_seconds"),
    ("kv_block_reuse_gap_seconds", "Time a cached KV block sat free before a prefix hit took it again.",
     "kv_block_reuse_gap_seconds"),
]


def _block_time_families(snap: dict, model_name: str):
    for name, doc, key in BLOCK_HISTOGRAMS:
        h = snap.get(key)
        if h is None:
            continue
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        buckets = [("+Inf" if bound == float("inf") else str(bound), n) for bound, n in h["buckets"]]
        family.add_metric([model_name], buckets, h["sum"])
        yield family


class _Renamed(Collector):
    """The families of `source` that `names` lists, again under each new name (same labels, values)."""

    def __init__(self, source: CollectorRegistry, names: dict[str, tuple[str, ...]], prefix: str):
        self.source, self.names, self.prefix = source, names, prefix

    def collect(self):
        for family in self.source.collect():
            for name in self.names.get(family.name.removeprefix(PREFIX), ()):
                yield _renamed(family, self.prefix + name)


def _renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` named `name`; its samples keep their suffixes (_total, _bucket, ...)."""
    out = Metric(name, family.documentation, family.type)
    out.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return out


class ServerMetrics:
    """The app's registry: engine gauges/counters plus per-request histograms."""

    def __init__(self, model_name: str, max_model_len: int):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        self.aliases = CollectorRegistry()  # the same metrics under other engines' names

        def hist(name: str, doc: str, buckets: list[float]):
            return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        tokens = token_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two generated tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request.", tokens)

    def export_vllm_names(self) -> None:
        """Also export the metrics vLLM has under their `vllm:` names (`--metrics-names vllm`)."""
        self.aliases.register(_Renamed(self.registry, VLLM_NAMES, VLLM_PREFIX))

    def observe_finished(self, r: FinishedRequest) -> None:
        """Observe one finished request (called on the engine thread)."""
        for h, x in ((self.ttft, r.ttft), (self.queue, r.queue_time), (self.e2e, r.e2e)):
            if x is not None:
                h.observe(x)
        for gap in r.inter_token_latencies:
            self.itl.observe(gap)
        self.prompt_tokens.observe(r.num_prompt_tokens)
        self.generation_tokens.observe(r.num_generation_tokens)

    def render(self, snapshot: dict) -> bytes:
        """The exposition text for one scrape, given a fresh engine metrics snapshot."""
        with self.engine.lock:
            self.engine.snapshot = snapshot
        return generate_latest(self.registry) + generate_latest(self.aliases)
