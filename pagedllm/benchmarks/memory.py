"""KV memory benchmark (``pagedllm bench memory``, also ``bench/memory.py``).

Three measurements, after Kwon et al. 2023 (PagedAttention), sections 6.1-6.3:

(a) Paged blocks vs contiguous reservation on the throughput workload (``bench throughput``'s
    64 requests, ignore_eos) at one KV budget: requests running concurrently and the fraction
    of allocated KV slots that hold a written token, sampled every step. Both run the real
    ``Scheduler``; the baseline's cache manager reserves each request's whole span at admission
    (``max_model_len``, or ``prompt + max_tokens``), token-granular. With ``ignore_eos`` the
    schedule depends only on lengths, never on token values, so the model is replaced by a stub
    that returns token 0: the figures are those of a real run, obtained in seconds.
(b) Shared system prompt: 64 requests with the same ~400-token prefix and different questions,
    through the real model, prefix caching on vs off: peak KV blocks in use, prompt tokens
    actually computed, and the throughput ratio.
(c) Sharing for n=4 parallel sampling (scheduler replay as in (a)) and beam width 4 (real
    model, since which beams survive depends on the values): mean over steps of the distinct
    blocks in use vs the sum of every sequence's own block-table length (what the sequences
    would hold without sharing).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from pagedllm.benchmarks.throughput import TEXT_PATH, BenchRequest, build_workload
from pagedllm.config import EngineArgs
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


@dataclass
class ReplayResult:
    """Per-step samples of a scheduler replay.

    Attributes:
        running: requests running after each step.
        utilization: written token slots / allocated token slots after each step.
        distinct_blocks: blocks in use after each step.
        table_blocks: sum of every sequence's block-table length after each step.
    """

    running: list[int] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)
    distinct_blocks: list[int] = field(default_factory=list)
    table_blocks: list[int] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.running)


class ContiguousKVCacheManager(KVCacheManager):
    """The baseline: a request reserves ``reserve(request)`` token slots at once, as a
    contiguous KV cache must, and holds them until it ends. Token-granular (block size 1),
    no prefix caching.

    Args:
        num_tokens: the budget in token slots.
        reserve: tokens a request reserves.
    """

    def __init__(self, num_tokens: int, reserve: Callable[[Request], int]) -> None:
        super().__init__(num_tokens, 1, enable_caching=False)
        self.reserve = reserve

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None) -> bool:
        if request.request_id in self.req_to_blocks:
            return True
        span = self.reserve(request)
        if span > self.block_pool.num_free_blocks:
            return False
        self.req_to_blocks[request.request_id] = self.block_pool.allocate(span)
        self._requests[request.request_id] = request
        return True


def replay(workload: list[BenchRequest], manager: KVCacheManager, max_num_seqs: int,
           max_num_batched_tokens: int, max_model_len: int, n: int = 1) -> ReplayResult:
    """Run the real scheduler over ``workload`` with a stub model (every token is 0).

    Returns:
        The per-step samples (see ``ReplayResult``).
    """
    scheduler = Scheduler(manager, max_num_seqs, max_num_batched_tokens, max_model_len)
    for index, item in enumerate(workload):
        params = SamplingParams(n=n, temperature=0.0, ignore_eos=True, max_tokens=item.output_len)
        samples = [Request(f"{i}_{index}", item.prompt_token_ids, params, item.output_len, None,
                           arrival_time=float(index)) for i in range(n)]
        samples[0].pending_forks = samples[1:]
        scheduler.add_request(samples[0])
    result = ReplayResult()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        manager.take_pending_copies()
        sampled = {}
        for request, num_new in output.scheduled:
            if request.num_computed_tokens + num_new == request.num_tokens:
                for sequence in (request, *request.pending_forks):
                    sampled[sequence.request_id] = 0
        scheduler.update_from_output(output, sampled)
        stored = sum(r.num_computed_tokens for r in scheduler.running)
        if manager.block_size == 1:
            allocated = manager.block_pool.num_used_blocks
        else:
            stats = manager.get_stats()
            stored, allocated = stats.num_stored_tokens, stats.num_used_blocks * manager.block_size
        result.running.append(scheduler.num_running)
        result.utilization.append(stored / allocated if allocated else 1.0)
        result.distinct_blocks.append(manager.block_pool.num_used_blocks)
        result.table_blocks.append(sum(len(blocks) for blocks in manager.req_to_blocks.values()))
    return result


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def measure_paged_vs_contiguous(workload: list[BenchRequest], budget_tokens: int, block_size: int,
                                max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                                log: Callable[[str], None] = print) -> dict[str, ReplayResult]:
    """(a): the same workload and budget through paged blocks and two contiguous baselines."""
    systems = {
        "paged": KVCacheManager(budget_tokens // block_size, block_size, enable_caching=False),
        "contiguous max_model_len": ContiguousKVCacheManager(budget_tokens, lambda r: max_model_len),
        "contiguous prompt+max_tokens": ContiguousKVCacheManager(
            budget_tokens, lambda r: r.num_prompt_tokens + r.max_tokens),
    }
    results = {}
    log(f"(a) {len(workload)} requests, KV budget {budget_tokens} tokens, max_model_len {max_model_len}, "
        f"block_size {block_size} (scheduler replay, stub model)")
    for name, manager in systems.items():
        result = replay(workload, manager, max_num_seqs, max_num_batched_tokens, max_model_len)
        results[name] = result
        log(f"    {name:>29}: {result.num_steps:5d} steps, mean {_mean(result.running):5.1f} / max "
            f"{max(result.running):3d} requests running, KV slots holding tokens {100 * _mean(result.utilization):5.1f}%")
    return results


def shared_prefix_workload(tokenizer, num_requests: int = 64, prefix_tokens: int = 400,
                           output_len: int = 16) -> list[BenchRequest]:
    """(b)'s workload: one ``prefix_tokens`` system prompt, then a different 12-40 token
    "question" per request, both cut from the shipped text."""
    tokens = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    system = tokens[:prefix_tokens]
    workload = []
    for index in range(num_requests):
        start = prefix_tokens + 97 * index
        question = [tokens[(start + i) % len(tokens)] for i in range(12 + index % 29)]
        workload.append(BenchRequest(system + question, output_len))
    return workload


def measure_shared_prefix(llm_factory: Callable[[bool], object], workload: list[BenchRequest],
                          log: Callable[[str], None] = print) -> dict:
    """(b): peak blocks, prompt tokens computed and elapsed time with caching on and off.

    Drives the engine through its public loop (``add_request`` / ``step``) and reads only the
    ``SchedulerStats`` snapshot each step publishes: ``iteration.num_prompt_tokens`` counts the
    prompt tokens actually computed (cache hits are not), ``num_used_blocks`` the blocks in use.
    """
    figures = {}
    for caching in (False, True):
        engine = llm_factory(caching).llm_engine
        counts = {"prompt_tokens_computed": 0, "peak_blocks": 0}
        for index, request in enumerate(workload):
            engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.make_stats()
            counts["prompt_tokens_computed"] += stats.iteration.num_prompt_tokens
            counts["peak_blocks"] = max(counts["peak_blocks"], stats.num_used_blocks)
        counts["elapsed_s"] = time.perf_counter() - start
        figures["on" if caching else "off"] = counts
        log(f"    prefix caching {'on ' if caching else 'off'}: peak {counts['peak_blocks']:4d} blocks in use, "
            f"{counts['prompt_tokens_computed']:6d} prompt tokens computed, {counts['elapsed_s']:6.1f} s")
    figures["speedup"] = figures["off"]["elapsed_s"] / figures["on"]["elapsed_s"]
    log(f"    throughput ratio on/off: {figures['speedup']:.2f}x")
    return figures


class _SnapshotEveryStep:
    """The engine for ``beam_search``, unchanged, except that each ``step()`` also records the
    block pool's ``KVCacheSnapshot`` (public API only: ``step`` and ``make_kv_snapshot``)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.snapshots = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        outputs = self._engine.step()
        self.snapshots.append(self._engine.make_kv_snapshot())
        return outputs


def measure_beam_sharing(llm, prompts: list[list[int]], beam_width: int, max_tokens: int,
                         log: Callable[[str], None] = print) -> tuple[float, float]:
    """(c) beam part: mean over the steps of the blocks in use vs the summed block tables of the
    running sequences (what they would hold without sharing), from the engine's KV snapshots."""
    from pagedllm.beam_search import BeamSearchParams, beam_search

    engine = _SnapshotEveryStep(llm.llm_engine)
    beam_search(engine, [{"prompt_token_ids": p} for p in prompts],
                BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True))
    busy = [s for s in engine.snapshots if s.counters.num_used_blocks]
    distinct = [s.counters.num_used_blocks for s in busy]
    tables = [sum(len(r.block_table) for r in s.requests) for s in busy]
    return _mean(distinct), _mean(tables)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-budget-tokens", type=int, default=16384,
                        help="KV budget of (a), in token slots (default 16384)")
    parser.add_argument("--shared-requests", type=int, default=64, help="requests of (b) (default 64)")
    parser.add_argument("--beam-prompts", type=int, default=4, help="prompts of (c)'s beam search (default 4)")
    parser.add_argument("--beam-max-tokens", type=int, default=64, help="tokens per beam in (c) (default 64)")
    parser.add_argument("--skip-model", action="store_true",
                        help="only the scheduler replays (a) and (c, n=4): no model is loaded")


def main(args: argparse.Namespace, engine_args: EngineArgs, log: Callable[[str], None] = print) -> int:
    """Run (a), (b) and (c) and print their figures."""
    from pagedllm.llm import LLM
    from pagedllm.models.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(engine_args.model))
    block_size = engine_args.block_size
    max_model_len = engine_args.max_model_len or 2048
    max_num_seqs = engine_args.max_num_seqs
    max_num_batched_tokens = engine_args.max_num_batched_tokens
    workload = build_workload(tokenizer)
    measure_paged_vs_contiguous(workload, args.kv_budget_tokens, block_size, max_model_len,
                                max_num_seqs, max_num_batched_tokens, log)

    log("(c) sharing, mean over steps of blocks in use with sharing vs without (sum of block tables)")
    samples = replay(workload[:16], KVCacheManager(args.kv_budget_tokens // block_size, block_size,
                                                   enable_caching=False),
                     max_num_seqs, max_num_batched_tokens, max_model_len, n=4)
    with_sharing, without = _mean(samples.distinct_blocks), _mean(samples.table_blocks)
    log(f"    n=4 parallel sampling, 16 requests of the workload: {with_sharing:7.1f} vs {without:7.1f} "
        f"blocks, {100 * (1 - with_sharing / without):4.1f}% saved")
    if args.skip_model:
        return 0

    def make_llm(caching: bool) -> LLM:
        return LLM(**dataclasses.asdict(dataclasses.replace(engine_args, enable_prefix_caching=caching)))

    llm = make_llm(True)
    beam_prompts = [r.prompt_token_ids[:128] for r in workload[:args.beam_prompts]]
    with_sharing, without = measure_beam_sharing(llm, beam_prompts, 4, args.beam_max_tokens, log)
    log(f"    beam width 4, {len(beam_prompts)} prompts of <= 128 tokens, {args.beam_max_tokens} tokens: "
        f"{with_sharing:7.1f} vs {without:7.1f} blocks, {100 * (1 - with_sharing / without):4.1f}% saved")
    del llm

    log(f"(b) {args.shared_requests} requests sharing a 400-token system prompt, 16 output tokens each")
    measure_shared_prefix(make_llm, shared_prefix_workload(tokenizer, args.shared_requests), log)
    return 0
