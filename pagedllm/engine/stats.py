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
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    iteration: IterationStats = field(default_factory=IterationStats)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage``)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


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
