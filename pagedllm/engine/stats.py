"""What the engine publishes to observers: immutable snapshots, never the engine itself.

vLLM v1's ``SchedulerStats`` / ``Scheduler.make_stats()`` (``vllm/v1/metrics/stats.py``): the
engine thread builds a snapshot after every step (``LLMEngine.make_stats()``); metrics, the
stats log line, the async engine's load shedding, and later ``/load``, dashboards and routers
read only the snapshot. ``AsyncLLMEngine`` publishes the newest one by swapping an attribute
(one reference store, atomic in CPython), so a reader on another thread always sees a whole,
consistent snapshot and never touches the scheduler or the KV cache manager.

``ModelInfo`` is the other half: the facts about the served model that do not change while it
runs (``max_model_len``, vocabulary, tokenizer, pool size), taken once before the engine thread
starts, so the HTTP server never reads ``LLMEngine`` attributes from the event loop.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class IterationStats:
    """What one ``step()`` scheduled (all zero for a step that scheduled nothing).

    Attributes:
        step: serial number of the step (1 for the first; 0: no step has run yet). Lets a
            consumer tell a new iteration from one it has already recorded.
        num_scheduled_tokens: tokens computed in the step (prompt + output).
        num_prompt_tokens: of those, prompt tokens (prefill chunks).
        num_output_tokens: of those, generated tokens: one per decoding sequence, plus the
            output tokens a preempted sequence recomputes when it is admitted again.
        num_preempted: sequences preempted while the step was scheduled.
        queue_times: for each sequence scheduled for the first time in this step, seconds
            from its arrival to the step's start (never negative). A preempted sequence that
            is scheduled again is not counted twice.
    """

    step: int = 0
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preempted: int = 0
    queue_times: tuple[float, ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's state at one moment, as counts (vLLM ``SchedulerStats``).

    Attributes:
        num_running_reqs: sequences in the running batch.
        num_waiting_reqs: sequences waiting to be scheduled (preempted ones included).
        num_blocks: KV cache blocks in the pool.
        num_used_blocks: blocks with ``ref_count >= 1``.
        num_preemptions: sequences preempted since the engine was built.
        prefix_cache_queries: prompt tokens looked up in the prefix cache since the engine was
            built.
        prefix_cache_hits: of those, tokens whose K/V was found.
        iteration: what the latest step did (``step == 0`` before the first step).
        num_waiting_by_priority: ``(priority, waiting sequences)`` pairs, ascending, under
            the ``priority`` scheduling policy (empty under ``fcfs``): how many wait ahead of
            a new request of a given priority.
        running_lora_adapters / waiting_lora_adapters: ``(lora_name, sequences)`` pairs by
            name, of the running / waiting sequences that have a LoRA adapter (vLLM's
            ``LoRAStats``; ``vllm:lora_requests_info``).
        spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens:
            speculative decoding since the engine was built (vLLM's counters): times a
            sequence verified drafts in a step, drafts verified, drafts accepted.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    iteration: IterationStats = field(default_factory=IterationStats)
    num_waiting_by_priority: tuple[tuple[int, int], ...] = ()
    running_lora_adapters: tuple[tuple[str, int], ...] = ()
    waiting_lora_adapters: tuple[tuple[str, int], ...] = ()
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    def num_waiting_ahead(self, priority: Optional[int]) -> int:
        """Sequences a new request of ``priority`` queues behind: all waiting ones under
        ``fcfs`` (or with ``priority`` None), those of priority <= ``priority`` under
        ``priority`` (aging left out)."""
        if priority is None or not self.num_waiting_by_priority:
            return self.num_waiting_reqs
        return sum(count for value, count in self.num_waiting_by_priority if value <= priority)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage``)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / verified drafts since start (0.0 before any)."""
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0


@dataclass(frozen=True)
class ModelInfo:
    """Fixed facts about the served model and its engine, for the HTTP server.

    Attributes:
        model: the engine's ``model`` option (a path or name; None for an injected model).
        max_model_len: most tokens (prompt + output) of one request.
        vocab_size: token ids are in ``[0, vocab_size)``.
        eos_token_id: the end-of-sequence token (None: none).
        tokenizer: the engine's tokenizer (None: prompts must be token ids). The one shared
            object: the server only encodes and decodes with it, as the engine thread does.
        block_size: tokens per KV cache block.
        num_blocks: blocks in the KV cache pool.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens computed in one step.
        grammar_compiler: compiles ``structured_outputs`` (thread-safe, cached; None without
            a tokenizer). Shared like the tokenizer: the server compiles in a worker thread
            so that the engine thread finds the grammar in the cache.
        scheduling_policy: ``"fcfs"`` or ``"priority"``.
        kv_cache_dtype: the KV cache's dtype, as a name (``"bfloat16"``, ``"float32"``, ``"int8"``).
        bytes_per_block: bytes of one KV block, every layer's K and V (all ranks together).
        max_loras: most LoRA adapters in use at once; 0 when LoRA is off.
    """

    model: Optional[str]
    max_model_len: int
    vocab_size: int
    eos_token_id: Optional[int]
    tokenizer: Any
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    grammar_compiler: Any = None
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = ""
    bytes_per_block: int = 0
    max_loras: int = 0


@dataclass(frozen=True)
class LoadStats:
    """Recent engine throughput, for ``/load`` and overload protection.

    Attributes:
        step_time: mean wall seconds of the recent steps (0.0: no step yet).
        finish_rate: requests finished per second over the recent finishes, counted from the
            start of the step that made the first of them to the snapshot (0.0: fewer than
            two finishes seen, so unknown).
        num_steps: steps the mean is over.
        num_finished: finishes the rate is over.
    """

    step_time: float = 0.0
    finish_rate: float = 0.0
    num_steps: int = 0
    num_finished: int = 0

    def estimated_wait(self, stats: SchedulerStats, max_num_seqs: int,
                       priority: Optional[int] = None) -> Optional[float]:
        """Seconds until a new request of ``priority`` would be scheduled, from ``stats``.

        With a free seat and nobody waiting ahead, it is one step (the next one admits it).
        Otherwise the ``k`` sequences ahead and the request itself each need a seat, and
        seats free up at ``finish_rate``: ``(k + 1) / finish_rate`` (a queue served at the
        recent departure rate). KV-cache space, prompt lengths and aging are left out.

        Returns:
            Seconds, or None when it cannot be estimated yet (no finish rate).
        """
        ahead = stats.num_waiting_ahead(priority)
        if ahead == 0 and stats.num_running_reqs < max_num_seqs:
            return self.step_time
        if self.finish_rate <= 0:
            return None
        return (ahead + 1) / self.finish_rate


class LoadTracker:
    """The engine thread's record of recent step times and finishes; ``snapshot()`` makes the
    ``LoadStats`` it publishes.

    Args:
        window: how many recent steps and finishes to keep.
    """

    def __init__(self, window: int = 32) -> None:
        self._step_times: deque[float] = deque(maxlen=window)
        self._finish_steps: deque[float] = deque(maxlen=window)  # each finish's step start

    def record_step(self, duration: float, num_finished: int, now: float) -> None:
        """One step took ``duration`` seconds and finished ``num_finished`` requests at
        ``now`` (monotonic seconds)."""
        self._step_times.append(duration)
        self._finish_steps.extend([now - duration] * num_finished)

    def snapshot(self, now: float) -> LoadStats:
        """The finish rate is the kept finishes over the time from the start of the step that
        made the first of them to ``now``, not to the last finish: a rate decays while nothing
        finishes, and finishes all made by one step still give one (their count over it)."""
        steps, finishes = self._step_times, self._finish_steps
        step_time = math.fsum(steps) / len(steps) if steps else 0.0
        rate = len(finishes) / (now - finishes[0]) if len(finishes) >= 2 and now > finishes[0] else 0.0
        return LoadStats(step_time, rate, len(steps), len(finishes))
