"""Prometheus metrics: exact values after known work, the stats log line, and the operations
kit (alert rules through ``promtool``, Grafana panels against a live scrape)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.metrics import EngineMetrics
from pagedllm.sampling_params import SamplingParams
from tests.conftest import make_tiny_engine
from tests.test_server import InThreadServer, idle, scrape, wait_for_metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture(scope="module")
def server():
    with InThreadServer(make_tiny_engine()) as server:
        yield server


def post_all(url: str, bodies: list[dict]) -> list[dict]:
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            responses = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
        return [r.json() for r in responses]
    return asyncio.run(run())


def delta(before: dict, after: dict, name: str) -> float:
    return after[name] - before[name]


def test_exact_values_after_10_requests(server):
    prompts = [[i + 1] * (i + 2) for i in range(10)]  # distinct first tokens: no prefix-cache hits
    num_prompt_tokens = sum(len(p) for p in prompts)
    before = scrape(server.url)
    results = post_all(server.url, [{"prompt": p, "max_tokens": 10, "ignore_eos": True} for p in prompts])
    assert [r["usage"]["completion_tokens"] for r in results] == [10] * 10
    after = wait_for_metrics(server.url, idle)
    expected = {
        "pagedllm:generation_tokens_total": 100,
        'pagedllm:request_success_total{finished_reason="length"}': 10,
        'pagedllm:request_success_total{finished_reason="stop"}': 0,
        'pagedllm:request_success_total{finished_reason="abort"}': 0,
        "pagedllm:time_to_first_token_seconds_count": 10,
        "pagedllm:inter_token_latency_seconds_count": 90,
        "pagedllm:e2e_request_latency_seconds_count": 10,
        "pagedllm:request_queue_time_seconds_count": 10,
        "pagedllm:prompt_tokens_total": num_prompt_tokens,
        "pagedllm:request_prompt_tokens_sum": num_prompt_tokens,
        "pagedllm:request_generation_tokens_sum": 100,
        # every prompt token once (prefill), then one token per request per decode step
        "pagedllm:iteration_tokens_total_sum": num_prompt_tokens + 90,
        "pagedllm:prefix_cache_queries_total": num_prompt_tokens,
        "pagedllm:prefix_cache_hits_total": 0,
        "pagedllm:num_preemptions_total": 0,
    }
    assert {name: delta(before, after, name) for name in expected} == expected
    assert after["pagedllm:num_requests_running"] == 0
    assert after["pagedllm:num_requests_waiting"] == 0
    assert after["pagedllm:kv_cache_usage_perc"] == 0
    assert after["pagedllm:max_num_seqs"] == 16 and after["pagedllm:engine_healthy"] == 1
    # make_tiny_engine: 64 blocks of 4 tokens, float32 K and V of 2 layers x 2 heads x 16 dims.
    config = 'block_size="4",bytes_per_block="2048",cache_dtype="float32",num_gpu_blocks="64"'
    assert after[f"pagedllm:cache_config_info{{{config}}}"] == after[f"vllm:cache_config_info{{{config}}}"] == 1


def test_samples_of_n_are_counted_per_sequence_and_prefix_hits_match_the_engine(server):
    before = scrape(server.url)
    prompt = list(range(1, 14))
    (result,) = post_all(server.url, [{"prompt": prompt, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 1}])
    (again,) = post_all(server.url, [{"prompt": prompt, "max_tokens": 5}])
    after = wait_for_metrics(server.url, idle)
    assert result["usage"]["completion_tokens"] == 15 and again["usage"]["completion_tokens"] == 5
    assert delta(before, after, 'pagedllm:request_success_total{finished_reason="length"}') == 4
    assert delta(before, after, "pagedllm:generation_tokens_total") == 20
    assert delta(before, after, "pagedllm:time_to_first_token_seconds_count") == 4
    stats = server.engine.stats  # the engine's own totals, as published to other threads
    assert after["pagedllm:prefix_cache_hits_total"] == stats.prefix_cache_hits > 0
    assert after["pagedllm:prefix_cache_queries_total"] == stats.prefix_cache_queries


def test_stats_log_line_reports_throughput_queues_and_kv_usage(caplog):
    engine = make_tiny_engine()
    metrics = EngineMetrics("m", engine.max_model_len, 16, 64, log_interval=0.0)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    engine.add_request("b", [6, 7], SamplingParams(max_tokens=3))
    metrics.request_added("a", time.monotonic())
    metrics.request_added("b", time.monotonic())
    outputs = engine.step()
    metrics.record_step(engine.make_stats(), outputs, time.monotonic())
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics"):
        metrics.log_if_due(engine.make_stats(), time.monotonic())
    (line,) = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    usage = 100 * engine.kv_cache_manager.usage
    assert "Running: 2 reqs, Waiting: 0 reqs" in line and f"KV cache usage: {usage:.1f}%" in line
    assert float(re.search(r"Avg prompt throughput: ([0-9.]+)", line).group(1)) > 0


def test_b31_garbage_in_the_metrics_path_never_raises():
    engine = make_tiny_engine()
    metrics = EngineMetrics("m", engine.max_model_len, 16, 64)
    metrics.request_added("x", time.monotonic())
    metrics.record_step(engine.make_stats(), [object()], 0.0)  # not a RequestOutput: logged, not raised
    metrics.update_gauges(object())
    assert "pagedllm:num_requests_running" in metrics.render().decode()


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions += [var["definition"] for var in dashboard["templating"]["list"] if "definition" in var]
    return expressions


def test_dashboard_queries_only_exported_metrics(server):
    exported = {key.split("{")[0] for key in scrape(server.url)}
    expressions = dashboard_expressions()
    assert len(expressions) >= 13
    used = {name for expr in expressions for name in re.findall(r"pagedllm:[A-Za-z0-9_:]+", expr)}
    assert used - exported == set()
    # Every exported series the issue lists has a panel.
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket", "iteration_tokens_total_bucket"):
        assert f"pagedllm:{name}" in used, name


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_alert_rules_pass_promtool_and_dashboard_queries_parse(tmp_path):
    prometheus = DEPLOY / "prometheus"
    subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=prometheus, check=True, capture_output=True)
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=prometheus, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # The dashboard's PromQL, with Grafana's variables filled in, parses as recording rules.
    rules = [{"record": f"dashboard:query_{i}",
              "expr": expr.replace("$__rate_interval", "5m").replace("$model_name", ".*")}
             for i, expr in enumerate(dashboard_expressions()) if not expr.startswith("label_values")]
    (tmp_path / "dashboard_rules.yml").write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "dashboard_rules.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_vllm_named_gauges_mirror_the_engine_snapshot():
    """Routers built for vLLM read ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.engine.stats import SchedulerStats

    metrics = EngineMetrics("m", 64, 16, 64, log_interval=None)
    metrics.update_gauges(SchedulerStats(num_running_reqs=3, num_waiting_reqs=5, num_blocks=8, num_used_blocks=2))
    values = {(sample.name, sample.labels["model_name"]): sample.value
              for family in text_string_to_metric_families(metrics.render().decode())
              for sample in family.samples if "model_name" in sample.labels}
    for prefix in ("pagedllm", "vllm"):
        assert values[(f"{prefix}:num_requests_running", "m")] == 3
        assert values[(f"{prefix}:num_requests_waiting", "m")] == 5
        assert values[(f"{prefix}:kv_cache_usage_perc", "m")] == 0.25
    metrics.engine_died()
    values = {sample.name: sample.value for family in text_string_to_metric_families(metrics.render().decode())
              for sample in family.samples}
    assert values["vllm:num_requests_waiting"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
