"""Sweeps of engine configurations over one trace, the report table, the recommendation and
the plots of ``pagedllm plan``."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from pagedllm.planner.cost_model import CostModel
from pagedllm.planner.replay import PlanConfig, PlanMetrics, ReplayResult, StepRecord, replay, summarize
from pagedllm.planner.trace import TraceRequest

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}

# A configuration is "as good as the best" within these (see ``recommend``).
THROUGHPUT_TOLERANCE = 0.95
LATENCY_TOLERANCE = 1.05


def parse_size(text: str) -> int:
    """Bytes of ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` (case-insensitive).

    Raises:
        ValueError: not a positive size with a known unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"a memory size must be a positive number with an optional unit (B, KiB, MiB, GiB, "
                         f"KB, MB, GB, ...), got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.4g} {unit}"
    return f"{num_bytes} B"


@dataclass
class SweepSpace:
    """The values to try; every combination is one configuration.

    Attributes:
        kv_cache_bytes: KV budgets (bytes); each becomes ``budget // bytes_per_block`` blocks,
            as ``worker/kv_cache_sizing.py`` sizes the pool for ``kv_cache_memory_bytes``.
        max_model_lens: None means the engine's default: the model's context length, capped
            by what the pool holds.
    """

    kv_cache_bytes: Sequence[int]
    max_model_lens: Sequence[Optional[int]] = (None,)
    max_num_seqs: Sequence[int] = (256,)
    max_num_batched_tokens: Sequence[int] = (2048,)
    block_sizes: Sequence[int] = (16,)
    prefix_caching: Sequence[bool] = (True, False)


def default_max_model_lens(trace: Sequence[TraceRequest]) -> list[Optional[int]]:
    """The engine's default and the smallest power of two that holds 99 % of the requests
    (prompt + output tokens): the choice the issue's story is about."""
    lengths = sorted(r.num_tokens for r in trace)
    p99 = lengths[min(len(lengths) - 1, math.ceil(0.99 * len(lengths)) - 1)]
    return [None, 1 << max(1, p99 - 1).bit_length()]


def build_configs(space: SweepSpace, cost_model: CostModel) -> list[tuple[Optional[PlanConfig], str]]:
    """Every combination as ``(config, "")``, or ``(None, why)`` for one the engine refuses."""
    configs: list[tuple[Optional[PlanConfig], str]] = []
    max_position = cost_model.facts.max_position_embeddings
    for budget, max_model_len, seqs, batched, block_size, caching in itertools.product(
            space.kv_cache_bytes, space.max_model_lens, space.max_num_seqs, space.max_num_batched_tokens,
            space.block_sizes, space.prefix_caching):
        num_blocks = budget // cost_model.facts.bytes_per_block(block_size)
        label = (f"kv={format_size(budget)} max_model_len={max_model_len or 'auto'} max_num_seqs={seqs} "
                 f"max_num_batched_tokens={batched} block_size={block_size} prefix_caching={caching}")
        if num_blocks < 1:
            configs.append((None, f"{label}: the budget holds no block of "
                                  f"{cost_model.facts.bytes_per_block(block_size)} bytes"))
            continue
        if max_model_len is None:
            max_model_len = min(max_position, num_blocks * block_size)
        elif max_model_len > max_position:
            configs.append((None, f"{label}: max_model_len is larger than the model's context length {max_position}"))
            continue
        config = PlanConfig(max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size,
                            max_num_seqs=seqs, max_num_batched_tokens=batched, enable_prefix_caching=caching,
                            kv_cache_bytes=budget)
        try:
            config.check()
        except ValueError as exc:
            configs.append((None, f"{label}: {exc}"))
            continue
        if config not in [c for c, _ in configs]:
            configs.append((config, ""))
    return configs


@dataclass
class SweepRow:
    config: PlanConfig
    result: ReplayResult
    metrics: PlanMetrics


def run_sweep(trace: Sequence[TraceRequest], configs: Sequence[PlanConfig], cost_model: CostModel,
              progress: Optional[Callable[[str], None]] = None) -> list[SweepRow]:
    rows = []
    for index, config in enumerate(configs):
        if progress is not None:
            progress(f"replaying configuration {index + 1}/{len(configs)}")
        result = replay(trace, config, cost_model)
        rows.append(SweepRow(config, result, summarize(result)))
    return rows


def recommend(rows: Sequence[SweepRow]) -> tuple[int, str]:
    """Pick one configuration and say why, in one paragraph.

    The rule: among the configurations that refuse the fewest requests, keep those whose
    throughput is within 5 % of the best and whose p95 TTFT is within 5 % (or 1 ms) of the
    best; of those, take the smallest KV budget, then the fewest preemptions, prefix caching on
    (it only saves work; p95 TTFTs within 5 % are noise), the lowest p95 TTFT, the largest
    ``max_model_len`` (free in a paged cache), in that order.

    Returns:
        ``(index into rows, paragraph)``.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no configuration to recommend: every one was refused")
    fewest = min(row.metrics.num_rejected for row in rows)
    candidates = [i for i, row in enumerate(rows) if row.metrics.num_rejected == fewest]
    best_throughput = max(rows[i].metrics.throughput for i in candidates)
    best_ttft = min(rows[i].metrics.ttft_p95 for i in candidates)
    good = [i for i in candidates if rows[i].metrics.throughput >= THROUGHPUT_TOLERANCE * best_throughput
            and rows[i].metrics.ttft_p95 <= max(LATENCY_TOLERANCE * best_ttft, best_ttft + 1e-3)]
    chosen = min(good, key=lambda i: (rows[i].config.kv_cache_bytes or 0, rows[i].metrics.num_preemptions,
                                      not rows[i].config.enable_prefix_caching, rows[i].metrics.ttft_p95,
                                      -rows[i].config.max_model_len, i))
    config, m = rows[chosen].config, rows[chosen].metrics
    refused = (f"all {m.num_requests} requests are served" if not m.num_rejected else
               f"{m.num_requests - m.num_rejected} of {m.num_requests} requests are served ({m.num_rejected} "
               "fit no configuration swept)")
    budget = config.kv_cache_bytes or 0
    cheaper_good = sorted({size for i in candidates
                           if (size := rows[i].config.kv_cache_bytes) is not None and size < budget})
    cheaper_any = sorted({size for row in rows if (size := row.config.kv_cache_bytes) is not None and size < budget})
    if cheaper_good:
        why_memory = (f"smaller budgets ({', '.join(format_size(b) for b in cheaper_good)}) lose more than 5 % of "
                      "throughput or p95 TTFT")
    elif cheaper_any:
        why_memory = (f"smaller budgets ({', '.join(format_size(b) for b in cheaper_any)}) reject more requests "
                      "as never fitting")
    else:
        why_memory = "it is the smallest KV budget swept"
    contiguous = m.contiguous_max_len_concurrency
    paragraph = (
        f"Recommended: max_model_len={config.max_model_len}, KV cache {format_size(config.kv_cache_bytes or 0)} "
        f"({config.num_blocks} blocks of {config.block_size} tokens), max_num_seqs={config.max_num_seqs}, "
        f"max_num_batched_tokens={config.max_num_batched_tokens}, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}. With it {refused}; its throughput "
        f"({m.throughput:.1f} output tokens/s) and p95 TTFT ({m.ttft_p95:.3f} s) are within 5 % of the best "
        f"the sweep reaches ({best_throughput:.1f} tokens/s, {best_ttft:.3f} s), and {why_memory}. It peaks at "
        f"{m.peak_blocks} of {m.num_blocks} blocks ({m.peak_blocks / m.num_blocks:.0%}) with {m.peak_concurrency} "
        f"requests running at once ({m.mean_concurrency:.1f} on average) and {m.num_preemptions} preemptions"
        + (f"; the prefix cache supplies {m.prefix_cache_saved:.0%} of the prompt tokens" if
           config.enable_prefix_caching and m.prefix_cache_saved > 0 else "")
        + f". A contiguous cache reserving max_model_len per request would hold only "
          f"{contiguous} request{'s' if contiguous != 1 else ''} in the same memory and leave "
          f"{m.contiguous_max_len_waste:.0%} of its reservation empty (paged: {m.paged_waste:.0%}).")
    return chosen, paragraph


_COLUMNS = (
    ("#", 3), ("max_len", 7), ("KV", 9), ("blocks", 6), ("bs", 3), ("seqs", 4), ("batch", 5), ("pfx", 3),
    ("rej", 4), ("conc pk/mean", 12), ("peak blk", 10), ("preempt", 7), ("queue p95", 9),
    ("TTFT p50/p95/p99 s", 20), ("TPOT p50/p95 ms", 15), ("tok/s", 7), ("waste pg/mml/exact", 18),
    ("pfx saved", 9))


def format_table(rows: Sequence[SweepRow], chosen: Optional[int] = None) -> str:
    """The sweep as a fixed-width text table, one configuration per line (``*`` marks the
    recommended one). Waste columns: paged, contiguous per ``max_model_len``, contiguous per
    prompt + max_tokens."""
    header = "  ".join(f"{name:>{width}}" for name, width in _COLUMNS)
    lines = [header, "-" * len(header)]
    for index, row in enumerate(rows):
        c, m = row.config, row.metrics
        cells = (f"{index + 1}{'*' if index == chosen else ''}", c.max_model_len, format_size(c.kv_cache_bytes or 0),
                 c.num_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens,
                 "on" if c.enable_prefix_caching else "off", m.num_rejected,
                 f"{m.peak_concurrency}/{m.mean_concurrency:.1f}",
                 f"{m.peak_blocks} {m.peak_blocks / m.num_blocks:.0%}",
                 m.num_preemptions, f"{m.queue_delay_p95:.3f}",
                 f"{m.ttft_p50:.3f}/{m.ttft_p95:.3f}/{m.ttft_p99:.3f}",
                 f"{m.tpot_p50 * 1e3:.1f}/{m.tpot_p95 * 1e3:.1f}", f"{m.throughput:.1f}",
                 f"{m.paged_waste:.0%}/{m.contiguous_max_len_waste:.0%}/{m.contiguous_exact_waste:.0%}",
                 f"{m.prefix_cache_saved:.0%}")
        lines.append("  ".join(f"{str(cell):>{width}}" for cell, (_, width) in zip(cells, _COLUMNS)))
    return "\n".join(lines)


def rejection_lines(row: SweepRow, limit: int = 5) -> list[str]:
    """Why the requests a configuration refuses never fit (the engine's own messages)."""
    rejected = row.result.rejected
    lines = [f"  {request.request_id} (line {request.line}): {reason}" for request, reason in rejected[:limit]]
    if len(rejected) > limit:
        lines.append(f"  ... and {len(rejected) - limit} more")
    return lines


def step_series(steps: Sequence[StepRecord], value: Callable[[StepRecord], float]) -> tuple[list[float], list[float]]:
    """Points of a step plot of ``value(step)`` over a replay (seconds, values): each step from its
    start, and 0 from the end of a step that an idle gap follows (as ``PlanMetrics`` counts idle
    time), so that a plot does not carry the last step's value across the gap."""
    times: list[float] = []
    values: list[float] = []
    for step, following in zip(steps, list(steps[1:]) + [None]):
        times.append(step.start)
        values.append(value(step))
        end = step.start + step.duration
        if following is None or following.start > end:
            times.append(end)
            values.append(0)
    return times, values


def write_plots(row: SweepRow, directory: Path) -> list[Path]:
    """PNG plots of one replay: concurrency over time, KV usage over time, latency CDFs.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    steps, config = row.result.steps, row.config

    def series(value: Callable[[StepRecord], float]) -> tuple[list[float], list[float]]:
        return step_series(steps, value)
    title = (f"max_model_len={config.max_model_len}, {config.num_blocks} blocks x {config.block_size}, "
             f"max_num_seqs={config.max_num_seqs}, prefix caching {'on' if config.enable_prefix_caching else 'off'}")
    paths = []

    figure, axes = plt.subplots(figsize=(9, 4))
    axes.step(*series(lambda s: s.num_running), where="post", label="running")
    axes.step(*series(lambda s: s.num_waiting), where="post", label="waiting")
    axes.set(xlabel="time (s)", ylabel="requests", title=f"Concurrency\n{title}")
    axes.legend()
    paths.append(directory / "concurrency.png")
    figure.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(9, 4))
    axes.step(*series(lambda s: 100 * s.num_used_blocks / config.num_blocks), where="post",
              label="blocks in use (paged)")
    capacity = config.num_blocks * config.block_size
    axes.step(*series(lambda s: 100 * min(1.0, s.reserved_max_model_len / capacity)), where="post",
              label="contiguous reservation of max_model_len (capped at 100 %)", alpha=0.7)
    axes.set(xlabel="time (s)", ylabel="% of the KV cache", ylim=(0, 105), title=f"KV cache usage\n{title}")
    axes.legend()
    paths.append(directory / "kv_usage.png")
    figure.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(figure)

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, values in ((axes[0], "TTFT (s)", [r.ttft for r in row.result.requests]),
                             (axes[1], "TPOT (ms)", [1e3 * r.tpot for r in row.result.requests if r.tpot is not None])):
        ordered = np.sort(values)
        ax.step(ordered, np.arange(1, len(ordered) + 1) / max(1, len(ordered)), where="post")
        ax.set(xlabel=name, ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    figure.suptitle(f"Predicted latency CDF\n{title}")
    paths.append(directory / "latency_cdf.png")
    figure.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(figure)
    return paths
