"""Replay a trace through the real ``Scheduler`` + ``KVCacheManager`` + ``BlockPool`` with no
model: the engine's step loop with a fake sampler and a simulated clock.

Each iteration mirrors ``AsyncLLMEngine._run`` and ``LLMEngine.step``: requests whose arrival
time has come are admitted (through ``InputProcessor``, so a request that can never fit is
refused with the engine's own message), the scheduler picks the batch, every sequence whose
chunk reaches its last token gets a token (always ``SAMPLED_TOKEN_ID``; outputs end by length
only, as with ``ignore_eos``), ``update_from_output`` advances and frees, and the clock moves
by the cost model's time for the step's shape. Since the scheduler and block pool are the
engine's own objects and the step sequence is the same, block counts, preemptions and batch
sizes are the engine's exactly; only time is modelled. When nothing is in flight the clock
jumps to the next arrival.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestId
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.stats import ModelInfo
from pagedllm.planner.cost_model import CostModel, step_shape
from pagedllm.planner.trace import TraceRequest
from pagedllm.sampling_params import SamplingParams

# Greedy decoding of equal token sequences gives equal tokens, so one constant id keeps the
# prefix cache's view of generated tokens the engine's: equal prompts share their outputs'
# blocks, different prompts never do (block keys chain over every earlier token).
SAMPLED_TOKEN_ID = 0


@dataclass(frozen=True)
class PlanConfig:
    """One engine configuration to replay (``EngineArgs`` names).

    Attributes:
        num_blocks: KV blocks in the pool.
        kv_cache_bytes: the budget ``num_blocks`` came from (reported only), or None.
    """

    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_bytes: Optional[int] = None

    def check(self) -> None:
        """The engine's own checks (``EngineArgs.verify`` and the pool-capacity check).

        Raises:
            ValueError: what ``LLMEngine`` would raise for this configuration, or more than
                ``MAX_REPLAY_BLOCKS`` blocks.
        """
        from pagedllm.config import EngineArgs

        EngineArgs(max_model_len=self.max_model_len, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                   max_num_batched_tokens=self.max_num_batched_tokens,
                   enable_prefix_caching=self.enable_prefix_caching,
                   num_gpu_blocks_override=self.num_blocks).verify()
        if self.num_blocks > MAX_REPLAY_BLOCKS:
            raise ValueError(f"the KV budget gives {self.num_blocks} blocks of {self.block_size} tokens; a replay "
                             f"holds at most {MAX_REPLAY_BLOCKS} blocks (its free list is a Python object per "
                             "block): give a smaller budget")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len > capacity:
            raise ValueError(f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of "
                             f"{self.block_size}), fewer than one request of max_model_len={self.max_model_len}")


MAX_REPLAY_BLOCKS = 1 << 22  # 67M tokens in blocks of 16, far beyond any real budget; a block is a Python object


@dataclass
class RequestRecord:
    """Times (seconds, the trace's clock) of one served request."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    output_tokens: int
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    finish_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def queue_delay(self) -> float:
        assert self.first_scheduled is not None, "read after the replay ends: every request was scheduled"
        return self.first_scheduled - self.arrival_time

    @property
    def ttft(self) -> float:
        assert self.first_token is not None, "read after the replay ends: every request has a token"
        return self.first_token - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean seconds per output token after the first (None for a one-token output)."""
        if self.output_tokens < 2:
            return None
        assert self.finish_time is not None and self.first_token is not None, "read after the replay ends"
        return (self.finish_time - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True)
class StepRecord:
    """One step, measured after ``schedule()`` (when its blocks are allocated).

    Attributes:
        start, duration: seconds.
        num_running, num_waiting: sequences in the batch / in the queue.
        num_scheduled_tokens: tokens computed in the step.
        num_used_blocks: blocks with ``ref_count >= 1``.
        num_tokens: tokens the running sequences hold after the step (a shared prefix counts
            once per sequence, as a contiguous cache would store it).
        num_empty_slots: slots of their blocks holding no token (the tail of each last block).
        reserved_max_model_len, reserved_exact: slots a contiguous cache would reserve for
            them: ``max_model_len`` each, or prompt + max_tokens each.
    """

    start: float
    duration: float
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_used_blocks: int
    num_tokens: int
    num_empty_slots: int
    reserved_max_model_len: int
    reserved_exact: int


@dataclass
class ReplayResult:
    """Everything a replay measured (see ``summarize`` for the figures derived from it)."""

    config: PlanConfig
    steps: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    rejected: list[tuple[TraceRequest, str]] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    start_time: float = 0.0
    end_time: float = 0.0


def replay(trace: Sequence[TraceRequest], config: PlanConfig, cost_model: CostModel) -> ReplayResult:
    """Run ``trace`` (sorted by arrival, as ``load_trace`` returns it) under ``config``.

    Raises:
        ValueError: ``config`` is one the engine refuses (``PlanConfig.check``).
    """
    config.check()
    manager = KVCacheManager(config.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
    scheduler = Scheduler(manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len)
    processor = InputProcessor(ModelInfo(
        model=None, max_model_len=config.max_model_len, vocab_size=cost_model.facts.vocab_size, eos_token_id=None,
        tokenizer=None, block_size=config.block_size, num_blocks=config.num_blocks,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens))
    result = ReplayResult(config)
    records: dict[RequestId, RequestRecord] = {}
    clock = result.start_time = trace[0].arrival_time if trace else 0.0
    next_index = 0
    while next_index < len(trace) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock = max(clock, trace[next_index].arrival_time)
        while next_index < len(trace) and trace[next_index].arrival_time <= clock:
            _admit(trace[next_index], next_index, processor, scheduler, records, result)
            next_index += 1
        if not scheduler.has_unfinished_requests():
            continue
        output = scheduler.schedule()
        if output.is_empty:
            if next_index == len(trace):
                raise RuntimeError(f"the replay made no progress with {scheduler.num_waiting} waiting requests")
            clock = trace[next_index].arrival_time
            continue
        duration = cost_model.step_time(step_shape(output.scheduled))
        sampled = {}
        num_tokens = output.total_num_scheduled_tokens
        for request, num_new in output.scheduled:
            record = records[request.request_id]
            if record.first_scheduled is None:
                record.first_scheduled = clock
            if request.num_computed_tokens + num_new == request.num_tokens:
                sampled[request.request_id] = SAMPLED_TOKEN_ID
        num_empty = reserved_exact = 0
        for request in scheduler.running:
            num_tokens += request.num_computed_tokens
            reserved_exact += request.num_prompt_tokens + request.max_tokens
            num_empty += len(manager.req_to_blocks[request.request_id]) * config.block_size
        num_empty -= num_tokens
        result.steps.append(StepRecord(
            start=clock, duration=duration, num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_scheduled_tokens=output.total_num_scheduled_tokens,
            num_used_blocks=manager.block_pool.num_used_blocks, num_tokens=num_tokens, num_empty_slots=num_empty,
            reserved_max_model_len=scheduler.num_running * config.max_model_len, reserved_exact=reserved_exact))
        clock += duration
        for request_id in sampled:
            record = records[request_id]
            if record.first_token is None:
                record.first_token = clock
        for request in scheduler.update_from_output(output, sampled):
            record = records[request.request_id]
            record.finish_time = clock
            record.num_cached_tokens = max(0, request.num_cached_tokens)
            record.num_preemptions = request.num_preemptions
    manager.block_pool.check_invariants()
    assert manager.block_pool.num_used_blocks == 0, "every request ended, so every block is free"
    result.end_time = clock
    result.num_preemptions = scheduler.num_preemptions
    result.prefix_cache_queries = manager.prefix_cache_queries
    result.prefix_cache_hits = manager.prefix_cache_hits
    result.requests = list(records.values())
    return result


def _admit(trace_request: TraceRequest, index: int, processor: InputProcessor, scheduler: Scheduler,
           records: dict[RequestId, RequestRecord], result: ReplayResult) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=trace_request.output_tokens, ignore_eos=True)
    try:
        processed = processor.process(trace_request.request_id, list(trace_request.prompt_token_ids), params,
                                      arrival_time=float(index))
    except ValueError as exc:
        result.rejected.append((trace_request, str(exc)))
        return
    # The engine orders requests by arrival (``time.monotonic()`` at add_request, distinct and
    # increasing); the trace's index is that order even where arrival times tie.
    scheduler.add_request(Request(processed.request_id, processed.prompt_token_ids, params, processed.max_tokens,
                                  eos_token_id=None, arrival_time=processed.arrival_time))
    records[trace_request.request_id] = RequestRecord(trace_request.request_id, trace_request.arrival_time,
                                                      trace_request.num_prompt_tokens, trace_request.output_tokens)


@dataclass(frozen=True)
class PlanMetrics:
    """The figures of one replay that the planner reports.

    Concurrency and KV figures are time-weighted over the replay's span (idle gaps count as
    zero). Waste is the share of reserved KV slots that hold no token: paged (empty tails of
    last blocks, over all in-use slots) and a contiguous cache reserving ``max_model_len`` or
    prompt + max_tokens per running request. Latencies are seconds; percentiles are numpy's
    (linear interpolation).
    """

    num_requests: int
    num_rejected: int
    peak_concurrency: int
    mean_concurrency: float
    max_waiting: int
    peak_blocks: int
    num_blocks: int
    mean_kv_usage: float
    num_preemptions: int
    queue_delay_p50: float
    queue_delay_p95: float
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    tpot_p50: float
    tpot_p95: float
    tpot_p99: float
    throughput: float  # output tokens / s over the span
    span: float
    paged_waste: float
    contiguous_max_len_waste: float
    contiguous_exact_waste: float
    contiguous_max_len_concurrency: int  # requests of max_model_len the same KV budget holds
    prefix_cache_hit_tokens: int
    prefix_cache_saved: float  # prompt tokens found in the cache at first admission, over all prompt tokens


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(result: ReplayResult) -> PlanMetrics:
    """Derive the reported figures from a replay."""
    config = result.config
    span = max(result.end_time - result.start_time, 1e-12)
    durations = np.asarray([s.duration for s in result.steps], dtype=np.float64)

    def weighted(values) -> float:
        return float(np.dot(durations, np.asarray(values, dtype=np.float64)) / span) if len(durations) else 0.0

    def waste(reserved: list[int], used: list[int]) -> float:
        total = float(np.dot(durations, reserved))
        return 1.0 - float(np.dot(durations, used)) / total if total else 0.0

    steps = result.steps
    served = result.requests
    tpots = [r.tpot for r in served if r.tpot is not None]
    num_prompt_tokens = sum(r.num_prompt_tokens for r in served)
    num_cached_tokens = sum(r.num_cached_tokens for r in served)
    return PlanMetrics(
        num_requests=len(served) + len(result.rejected), num_rejected=len(result.rejected),
        peak_concurrency=max((s.num_running for s in steps), default=0),
        mean_concurrency=weighted([s.num_running for s in steps]),
        max_waiting=max((s.num_waiting for s in steps), default=0),
        peak_blocks=max((s.num_used_blocks for s in steps), default=0), num_blocks=config.num_blocks,
        mean_kv_usage=weighted([s.num_used_blocks for s in steps]) / config.num_blocks,
        num_preemptions=result.num_preemptions,
        queue_delay_p50=_percentile([r.queue_delay for r in served], 50),
        queue_delay_p95=_percentile([r.queue_delay for r in served], 95),
        ttft_p50=_percentile([r.ttft for r in served], 50), ttft_p95=_percentile([r.ttft for r in served], 95),
        ttft_p99=_percentile([r.ttft for r in served], 99),
        tpot_p50=_percentile(tpots, 50), tpot_p95=_percentile(tpots, 95), tpot_p99=_percentile(tpots, 99),
        throughput=sum(r.output_tokens for r in served) / span, span=span,
        paged_waste=waste([s.num_used_blocks * config.block_size for s in steps],
                          [s.num_used_blocks * config.block_size - s.num_empty_slots for s in steps]),
        contiguous_max_len_waste=waste([s.reserved_max_model_len for s in steps], [s.num_tokens for s in steps]),
        contiguous_exact_waste=waste([s.reserved_exact for s in steps], [s.num_tokens for s in steps]),
        contiguous_max_len_concurrency=config.num_blocks * config.block_size // config.max_model_len,
        prefix_cache_hit_tokens=result.prefix_cache_hits,
        prefix_cache_saved=num_cached_tokens / num_prompt_tokens if num_prompt_tokens else 0.0)
