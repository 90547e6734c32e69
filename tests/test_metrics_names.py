"""`kvserve serve --metrics-names vllm` (vLLM's metric names beside kvserve's) and the Grafana
dashboard in examples/grafana/, both against the /metrics of a live server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import Server

from kvserve.server.metrics import VLLM_NAMES, ServerMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "kvserve.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                "and", "or", "unless"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label matchers, ranges, grouping lists and function
    calls left out)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    words = re.finditer(r"(?<![\w$])([A-Za-z_:][\w:]*)(\s*\()?", expr)
    return {m.group(1) for m in words if m.group(2) is None and m.group(1) not in PROMQL_WORDS}


def dashboard_metric_names(dashboard: dict) -> set[str]:
    """Every metric the dashboard's panels and template variables query."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= promql_metric_names(target["expr"])
    for var in dashboard["templating"]["list"]:
        query = var.get("definition", "")
        if query.startswith("label_values("):
            names.add(query[len("label_values("):].split(",")[0].strip())
    return names


def scrape(srv: Server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one /metrics scrape."""
    r = httpx.get(f"{srv.url}/metrics", timeout=10)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


@pytest.fixture(scope="module")
def server():
    """Serving with vLLM's names, a CPU KV tier and swap space, after one request and its repeat."""
    srv = Server("--metrics-names", "vllm", "--kv-tier", "cpu:64MiB", "--swap-space", "0.0625",
                 "--enforce-eager")
    body = {"prompt": "The key-value cache of a transformer stores " * 4, "max_tokens": 4}
    for _ in range(2):
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).status_code == 200
    yield srv
    assert srv.stop() == 0, srv.output()


def test_promql_metric_names():
    expr = ('histogram_quantile(0.9, sum by (le) (rate(kvserve:ttft_bucket{model_name=~"$m"}[$__rate_interval]))) '
            '/ ignoring (source) group_left sum(kvserve:hits_total offset 5m) - up')
    assert promql_metric_names(expr) == {"kvserve:ttft_bucket", "kvserve:hits_total", "up"}


def test_dashboard_queries_only_metrics_a_live_server_exports(server):
    dashboard = json.loads(DASHBOARD.read_text())
    queried = dashboard_metric_names(dashboard)
    for wanted in ("kvserve:kv_cache_usage_perc", "kvserve:num_blocks_free", "kvserve:num_blocks_cached",
                   "kvserve:prefix_cache_hits_by_source_total", "kvserve:num_preemptions_total",
                   "kvserve:num_swapped_out_blocks_total", "kvserve:kv_tier_read_bytes_total",
                   "kvserve:time_to_first_token_seconds_bucket",
                   "kvserve:inter_token_latency_seconds_bucket"):
        assert wanted in queried
    live = {name for name, _ in scrape(server)}
    assert queried <= live, f"the dashboard queries metrics /metrics does not have: {sorted(queried - live)}"


def test_vllm_names_repeat_the_kvserve_samples(server):
    samples = scrape(server)
    model = {dict(labels)["model_name"] for name, labels in samples if name.startswith("kvserve:")}
    assert model == {server.model}
    mirrored = 0
    for (name, labels), value in samples.items():
        short = name.removeprefix("kvserve:")
        for kv_name, vllm_names in VLLM_NAMES.items():
            if short.startswith(kv_name) and short[len(kv_name):] in ("", "_total", "_bucket", "_sum", "_count"):
                for vllm_name in vllm_names:
                    assert samples[("vllm:" + vllm_name + short[len(kv_name):], labels)] == value
                    mirrored += 1
    assert mirrored > 50
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert any(n == name for n, _ in samples), name
    assert samples[("vllm:prefix_cache_hits_total", (("model_name", server.model),))] > 0
    assert samples[("vllm:generation_tokens_total", (("model_name", server.model),))] == 8


def test_kvserve_names_only_by_default():
    metrics = ServerMetrics("m", 2048)
    snapshot = {"num_requests_running": 1, "kv_cache_usage": 0.5, "prefix_cache_queries": 3}
    assert b"vllm:" not in metrics.render(snapshot)
    metrics.export_vllm_names()
    text = metrics.render(snapshot).decode()
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.5' in text
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 3.0' in text
