"""Prometheus metrics and the periodic stats log line of a serving engine.

Names are vLLM's (``vllm/v1/metrics/loggers.py``: ``PrometheusStatLogger`` and
``LoggingStatLogger``) with the prefix ``pagedllm:`` instead of ``vllm:``, each labelled with
``model_name``. Two gauges have no vLLM counterpart and exist for the alert rules in
``deploy/prometheus/alerts.yml``: ``pagedllm:max_num_seqs`` (the configured limit, so that "running
near the limit" is one expression) and ``pagedllm:engine_healthy`` (0 once the engine loop died,
while the HTTP server still answers).

Three gauges are exported under vLLM's own names as well: ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``; so are the speculative decoding
counters ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens`` and
``vllm:spec_decode_num_accepted_tokens`` (acceptance rate = accepted / draft tokens). Routers and autoscalers built for
vLLM read exactly these (vllm-project/production-stack's router, the Gateway API Inference
Extension's endpoint picker), so they can route to pagedllm unchanged; three series cost nothing.

Everything is counted per *sequence* (one sample of an ``n > 1`` request), as vLLM v1 counts
its engine-core requests: ``n=2`` adds 2 to ``request_success`` and observes 2 TTFTs.

Each server owns a ``CollectorRegistry`` so that several servers can live in one process.

Inputs are data only: the engine's ``SchedulerStats`` snapshot (``LLMEngine.make_stats()``,
``pagedllm/engine/stats.py``) and the ``RequestOutput``s of each step; this module never reads
the engine, its scheduler or its KV cache manager.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from pagedllm.engine.stats import ModelInfo, SchedulerStats
    from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM ``build_1_2_5_buckets``)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _SequenceStats:
    num_tokens: int = 0
    last_token_time: float = 0.0
    finished: bool = False


@dataclass
class _RequestStats:
    arrival_time: float
    sequences: dict[int, _SequenceStats] = field(default_factory=dict)


@dataclass(frozen=True)
class _TwinCounter:
    """One count exported under two names (``pagedllm:`` and vLLM's ``vllm:``)."""

    own: Counter
    vllm: Counter

    def inc(self, amount: float) -> None:
        self.own.inc(amount)
        self.vllm.inc(amount)


@dataclass(frozen=True)
class _TwinGauge:
    """One value exported under two names (``pagedllm:`` and vLLM's ``vllm:``)."""

    own: Gauge
    vllm: Gauge

    def set(self, value: float) -> None:
        self.own.set(value)
        self.vllm.set(value)


class EngineMetrics:
    """The Prometheus series of one served model, updated from the engine loop thread.

    Args:
        model_name: value of the ``model_name`` label.
        max_model_len: top of the prompt/generation token histograms.
        max_num_seqs: exported as ``pagedllm:max_num_seqs``.
        max_num_batched_tokens: top of the ``iteration_tokens_total`` histogram.
        log_interval: seconds between stats log lines (None: no log line).
        model_info: the engine's fixed facts; given, the KV cache's configuration is exported as
            the labels of ``pagedllm:cache_config_info`` and ``vllm:cache_config_info`` (value 1):
            block_size (tokens), cache_dtype, num_gpu_blocks (vLLM's name for the pool's blocks)
            and bytes_per_block; with LoRA on (``max_loras > 0``) ``vllm:lora_requests_info`` too:
            labels ``max_lora``, ``running_lora_adapters`` and ``waiting_lora_adapters`` (adapter
            names, comma-separated, sorted), value the Unix time of the snapshot (vLLM's gauge).

    Every update method swallows and logs its own exceptions: metrics must never take the
    engine loop down (case B31).
    """

    def __init__(self, model_name: str, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, log_interval: Optional[float] = 10.0,
                 model_info: Optional["ModelInfo"] = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(model_name)

        def vllm_compatible_gauge(name: str, doc: str) -> "_TwinGauge":
            return _TwinGauge(gauge(name, doc), Gauge(f"vllm:{name}", doc + " (vLLM's name)", labels,
                                                      registry=self.registry).labels(model_name))

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(model_name)

        def vllm_compatible_counter(name: str, doc: str) -> "_TwinCounter":
            return _TwinCounter(counter(name, doc), Counter(f"vllm:{name}", doc + " (vLLM's name)", labels,
                                                            registry=self.registry).labels(model_name))

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = vllm_compatible_gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = vllm_compatible_gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = vllm_compatible_gauge("kv_cache_usage_perc",
                                                         "Fraction of KV cache blocks in use (1 = 100 percent).")
        self.max_num_seqs = gauge("max_num_seqs", "Configured limit of sequences running at once.")
        self.engine_healthy = gauge("engine_healthy", "1 while the engine loop runs, 0 once it died.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of sequences that got a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (sequences sent back to wait).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_decode_num_drafts = vllm_compatible_counter(
            "spec_decode_num_drafts", "Speculative decoding: times a sequence verified drafts in a step.")
        self.spec_decode_num_draft_tokens = vllm_compatible_counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_decode_num_accepted_tokens = vllm_compatible_counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        success = Counter("pagedllm:request_success", "Finished sequences by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        # Created up front so that every series exists (at 0) from the first scrape on.
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first generated token, seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between two generated tokens, seconds.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Arrival to finish, seconds.", _REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to first scheduled, seconds.", _REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished sequence.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished sequence.", token_buckets)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step.",
            [b for b in [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
             if b <= max_num_batched_tokens])
        self.max_num_seqs.set(max_num_seqs)
        self.engine_healthy.set(1)
        if model_info is not None:
            info = {"block_size": str(model_info.block_size), "cache_dtype": model_info.kv_cache_dtype,
                    "num_gpu_blocks": str(model_info.num_blocks), "bytes_per_block": str(model_info.bytes_per_block)}
            for prefix in ("pagedllm", "vllm"):
                Gauge(f"{prefix}:cache_config_info", "KV cache configuration, in the labels (value 1).",
                      [*labels, *info], registry=self.registry).labels(model_name, *info.values()).set(1)
        # vLLM's LoRA info gauge: its labels say which adapters running and waiting sequences
        # use; the value is when that was seen (Unix seconds). One series: the newest.
        self.lora_requests_info: Optional[Gauge] = None
        self._max_loras = str(model_info.max_loras) if model_info is not None else "0"
        if model_info is not None and model_info.max_loras:
            self.lora_requests_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                            registry=self.registry)

        self._requests: dict[str, _RequestStats] = {}
        self._last_step_recorded = 0
        self._num_preemptions_seen = 0
        self._prefix_queries_seen = 0
        self._prefix_hits_seen = 0
        self._spec_decode_seen = (0, 0, 0)
        self.log_interval = log_interval
        self._last_log_time = time.monotonic()
        self._prompt_tokens_since_log = 0
        self._generation_tokens_since_log = 0

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    # ----------------------------------------------------------------------------- updates
    def request_added(self, request_id: str, arrival_time: float) -> None:
        """Start tracking a request that the engine accepted (``arrival_time``: monotonic s)."""
        self._requests[request_id] = _RequestStats(arrival_time)

    def record_step(self, stats: "SchedulerStats", outputs: list["RequestOutput"], now: float) -> None:
        """Account one ``engine.step()`` that returned ``outputs`` at ``now`` (monotonic
        seconds), with ``stats`` the engine's snapshot taken after it. Outputs must be
        cumulative (the server's kind)."""
        try:
            self._record_iteration(stats)
            for output in outputs:
                self._record_output(output, now)
            self.update_gauges(stats)
        except Exception:
            logger.exception("metrics: recording a step failed (the engine keeps running)")

    def _record_iteration(self, stats: "SchedulerStats") -> None:
        iteration = stats.iteration
        if iteration.step == self._last_step_recorded:  # recorded already (or no step yet)
            return
        self._last_step_recorded = iteration.step
        if iteration.num_scheduled_tokens:
            self.iteration_tokens.observe(iteration.num_scheduled_tokens)
        for queue_time in iteration.queue_times:
            self.request_queue_time.observe(queue_time)

    def _record_output(self, output: "RequestOutput", now: float) -> None:
        stats = self._requests.get(output.request_id)
        if stats is None:
            return
        num_prompt_tokens = len(output.prompt_token_ids)
        for completion in output.outputs:
            sequence = stats.sequences.setdefault(completion.index, _SequenceStats())
            if sequence.finished:
                continue
            num_tokens = len(completion.token_ids)
            num_new = num_tokens - sequence.num_tokens
            if num_new > 0:
                if sequence.num_tokens == 0:
                    self.prompt_tokens.inc(num_prompt_tokens)
                    self._prompt_tokens_since_log += num_prompt_tokens
                    self.time_to_first_token.observe(now - stats.arrival_time)
                else:
                    self.inter_token_latency.observe((now - sequence.last_token_time) / num_new)
                self.generation_tokens.inc(num_new)
                self._generation_tokens_since_log += num_new
                sequence.num_tokens = num_tokens
                sequence.last_token_time = now
            if completion.finish_reason is not None:
                sequence.finished = True
                self._finish(completion.finish_reason, stats.arrival_time, num_prompt_tokens,
                             num_tokens, now)
        if output.finished:
            del self._requests[output.request_id]

    def _finish(self, reason: str, arrival_time: float, num_prompt_tokens: int, num_tokens: int,
                now: float) -> None:
        self.request_success[reason if reason in self.request_success else "error"].inc()
        self.e2e_request_latency.observe(now - arrival_time)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_tokens)

    def update_gauges(self, stats: "SchedulerStats") -> None:
        """Set the gauges and the preemption / prefix-cache counters from an engine snapshot
        (its running totals: a counter grows by what is new since the last snapshot)."""
        try:
            self.num_requests_running.set(stats.num_running_reqs)
            self.num_requests_waiting.set(stats.num_waiting_reqs)
            self.kv_cache_usage_perc.set(stats.kv_cache_usage)
            self.num_preemptions.inc(max(0, stats.num_preemptions - self._num_preemptions_seen))
            self._num_preemptions_seen = max(self._num_preemptions_seen, stats.num_preemptions)
            self.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries - self._prefix_queries_seen))
            self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - self._prefix_hits_seen))
            self._prefix_queries_seen = max(self._prefix_queries_seen, stats.prefix_cache_queries)
            self._prefix_hits_seen = max(self._prefix_hits_seen, stats.prefix_cache_hits)
            if self.lora_requests_info is not None:
                self.lora_requests_info.clear()
                self.lora_requests_info.labels(
                    self._max_loras, ",".join(name for name, _ in stats.waiting_lora_adapters),
                    ",".join(name for name, _ in stats.running_lora_adapters)).set_to_current_time()
            totals = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                      stats.spec_decode_num_accepted_tokens)
            for series, total, seen in zip((self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                                            self.spec_decode_num_accepted_tokens), totals, self._spec_decode_seen):
                series.inc(max(0, total - seen))
            self._spec_decode_seen = tuple(map(max, totals, self._spec_decode_seen))
        except Exception:
            logger.exception("metrics: reading the engine's stats failed (the engine keeps running)")

    def engine_died(self) -> None:
        """The engine loop died: every unfinished sequence counts once as ``error`` (a request
        that had no output yet counts as one sequence); the gauges drop to 0."""
        for stats in self._requests.values():
            for sequence in stats.sequences.values() or [_SequenceStats()]:
                if not sequence.finished:
                    self.request_success["error"].inc()
        self._requests.clear()
        self.engine_healthy.set(0)
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)
        self.kv_cache_usage_perc.set(0)

    # ----------------------------------------------------------------------------- log line
    def log_if_due(self, stats: "SchedulerStats", now: float) -> None:
        """Every ``log_interval`` seconds with activity, log throughput, queues, KV usage and
        prefix hit rate (vLLM ``LoggingStatLogger``)."""
        if self.log_interval is None or now - self._last_log_time < self.log_interval:
            return
        try:
            elapsed = now - self._last_log_time
            busy = stats.num_running_reqs or stats.num_waiting_reqs
            if busy or self._prompt_tokens_since_log or self._generation_tokens_since_log:
                hit_rate = stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)
                logger.info(
                    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    self._prompt_tokens_since_log / elapsed, self._generation_tokens_since_log / elapsed,
                    stats.num_running_reqs, stats.num_waiting_reqs, 100 * stats.kv_cache_usage,
                    100 * hit_rate)
        except Exception:
            logger.exception("metrics: the stats log line failed (the engine keeps running)")
        self._last_log_time = now
        self._prompt_tokens_since_log = 0
        self._generation_tokens_since_log = 0


class APIKeyMetrics:
    """Per-key series of the HTTP server, labelled ``key_name``: only the configured key names
    ever appear, or ``anonymous`` on a server without keys (a bounded set: an unknown bearer
    token is refused before it is counted), created at 0 up front.

    Series: ``pagedllm:api_key_requests_total{key_name, outcome}`` (outcome ``admitted``: the
    engine took it; ``rate_limited``: 429 for the key's limits; ``overloaded``: 503 from overload
    protection),
    ``pagedllm:api_key_tokens_total{key_name}`` (tokens charged: ``usage.total_tokens`` of
    finished requests) and ``pagedllm:api_key_requests_open{key_name}`` (requests of the key
    open now; only for keys with limits).

    Args:
        registry: the registry to add the series to (the engine metrics' one).
        model_name: value of the ``model_name`` label.
        key_names: the configured names; none: the server has no keys, and every caller is
            ``anonymous``.
    """

    OUTCOMES = ("admitted", "rate_limited", "overloaded")

    def __init__(self, registry: CollectorRegistry, model_name: str, key_names: list[str]) -> None:
        names = list(dict.fromkeys(key_names)) or ["anonymous"]
        requests = Counter("pagedllm:api_key_requests", "API requests by key name and outcome.",
                           ["model_name", "key_name", "outcome"], registry=registry)
        tokens = Counter("pagedllm:api_key_tokens", "Tokens charged to each key (usage.total_tokens).",
                         ["model_name", "key_name"], registry=registry)
        open_requests = Gauge("pagedllm:api_key_requests_open", "Requests of each key open now.",
                              ["model_name", "key_name"], registry=registry)
        self._requests = {(name, outcome): requests.labels(model_name, name, outcome)
                          for name in names for outcome in self.OUTCOMES}
        self._tokens = {name: tokens.labels(model_name, name) for name in names}
        self._open = {name: open_requests.labels(model_name, name) for name in names}

    def record(self, key_name: str, event: str, value: int) -> None:
        """``RateLimiter``'s ``on_event``: ``admitted``/``rate_limited``/``overloaded`` count
        one request, ``tokens`` adds ``value``, ``open`` sets the gauge. Unknown names are
        dropped, so that cardinality stays bounded."""
        if event == "tokens":
            counter = self._tokens.get(key_name)
            if counter is not None:
                counter.inc(value)
        elif event == "open":
            gauge = self._open.get(key_name)
            if gauge is not None:
                gauge.set(value)
        else:
            counter = self._requests.get((key_name, event))
            if counter is not None:
                counter.inc(value)
