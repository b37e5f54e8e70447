"""KV capacity of models at serving size, from their ``config.json`` alone: bytes per token by
KV dtype, and how many long-document requests a KV budget holds at once, paged (the planner's
replay: the engine's own scheduler, KV cache manager and block pool) against a contiguous
cache that reserves ``max_model_len`` per request.

    python -m pagedllm.planner.capacity bench/configs/*.json --kv-cache-bytes 16GiB

prints the Markdown table of docs/benchmarks.md ("Models at serving size"). The workload is
the one pagedllm is for: distinct documents of 4k tokens up to ``max_model_len`` less the
answer, 256-token answers, all arriving at once (``long_document_trace``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pagedllm.planner.cost_model import CostModel, FEATURES, ModelFacts
from pagedllm.planner.replay import PlanConfig, replay, summarize
from pagedllm.planner.sweep import format_size, parse_size
from pagedllm.planner.trace import TraceRequest

KV_ELEMENT_BYTES = {"bfloat16": 2, "int8": 1, "float32": 4}
ANSWER_TOKENS = 256
MIN_DOCUMENT_TOKENS = 4096


def facts_from_config(path: Path, kv_cache_dtype: str) -> ModelFacts:
    """The KV geometry of the model whose ``config.json`` is ``path`` (any ``model_type``: only
    layers, KV heads and head size are read, with transformers' defaults: ``head_dim`` is
    ``hidden_size / num_attention_heads`` and KV heads default to the attention heads).

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype not in KV_ELEMENT_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_ELEMENT_BYTES)}, got {kv_cache_dtype!r}")
    raw = json.loads(Path(path).read_text())
    heads = raw["num_attention_heads"]
    return ModelFacts(model=str(path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                      num_layers=raw["num_hidden_layers"], num_kv_heads=raw.get("num_key_value_heads") or heads,
                      head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                      kv_element_bytes=KV_ELEMENT_BYTES[kv_cache_dtype], vocab_size=raw["vocab_size"],
                      max_position_embeddings=raw.get("max_position_embeddings", 2048))


def long_document_trace(num_requests: int, max_model_len: int, vocab_size: int, seed: int = 0) -> list[TraceRequest]:
    """``num_requests`` distinct documents of ``MIN_DOCUMENT_TOKENS`` to ``max_model_len -
    ANSWER_TOKENS`` tokens (uniform), each answered in ``ANSWER_TOKENS`` tokens, all arriving at 0.

    Raises:
        ValueError: ``max_model_len`` leaves no room for a 4k document and its answer.
    """
    longest = max_model_len - ANSWER_TOKENS
    if longest < MIN_DOCUMENT_TOKENS:
        raise ValueError(f"max_model_len={max_model_len} holds no {MIN_DOCUMENT_TOKENS}-token document and "
                         f"{ANSWER_TOKENS}-token answer")
    rng = random.Random(seed)
    trace = []
    for index in range(num_requests):
        length = rng.randint(MIN_DOCUMENT_TOKENS, longest)
        # One id per document repeated: distinct across documents, so no block is shared.
        trace.append(TraceRequest(f"doc-{index}", 0.0, (index % vocab_size,) * length, ANSWER_TOKENS, None, index + 1))
    return trace


@dataclass(frozen=True)
class CapacityRow:
    """One model, KV dtype and ``max_model_len`` under one KV budget.

    Attributes:
        bytes_per_token: KV bytes of one token (K and V, every layer; int8 rows carry their scale).
        contiguous_requests: requests a cache reserving ``max_model_len`` per request holds.
        paged_peak_requests, paged_mean_requests: running requests of the replay, the most at
            once and the mean over its steps (each step weighs the same: no step times).
        num_preemptions: preemptions of the replay (a request evicted when the pool ran out).
        recompute_factor: tokens the replay computed over the tokens of the trace (prompts and
            answers, less each answer's last token, which is sampled, not computed): 1.0 means
            no preemption cost anything; each preemption recomputes a whole context.
    """

    model: str
    kv_cache_dtype: str
    bytes_per_token: int
    max_model_len: int
    kv_cache_bytes: int
    contiguous_requests: int
    paged_peak_requests: int
    paged_mean_requests: float
    num_preemptions: int
    recompute_factor: float


def capacity_row(facts: ModelFacts, kv_cache_bytes: int, max_model_len: int, num_requests: int = 64,
                 block_size: int = 16) -> CapacityRow:
    """Replay ``long_document_trace`` under a pool of ``kv_cache_bytes`` (sized as
    ``worker/kv_cache_sizing.py`` sizes ``kv_cache_memory_bytes``), chunks of 2,048 tokens.

    Raises:
        ValueError: the pool holds no block, less than one ``max_model_len`` request (the
            engine's refusal), or more blocks than a replay holds (``MAX_REPLAY_BLOCKS``).
    """
    # Every step weighs 1: the replay's block counts and batches do not depend on step times.
    unit_steps = CostModel({name: float(name == "intercept") for name in FEATURES}, facts)
    num_blocks = kv_cache_bytes // facts.bytes_per_block(block_size)
    if num_blocks < 1:
        raise ValueError(f"the budget holds no KV block of {facts.bytes_per_block(block_size)} bytes")
    config = PlanConfig(max_model_len=max_model_len, num_blocks=num_blocks, block_size=block_size,
                        enable_prefix_caching=False, kv_cache_bytes=kv_cache_bytes)
    trace = long_document_trace(num_requests, max_model_len, facts.vocab_size)
    result = replay(trace, config, unit_steps)
    metrics = summarize(result)
    trace_tokens = sum(len(r.prompt_token_ids) + r.output_tokens - 1 for r in trace)
    computed_tokens = sum(step.num_scheduled_tokens for step in result.steps)
    return CapacityRow(model=Path(facts.model or "model").stem, kv_cache_dtype=facts.kv_cache_dtype,
                       bytes_per_token=facts.bytes_per_block(block_size) // block_size, max_model_len=max_model_len,
                       kv_cache_bytes=kv_cache_bytes, contiguous_requests=metrics.contiguous_max_len_concurrency,
                       paged_peak_requests=metrics.peak_concurrency, paged_mean_requests=metrics.mean_concurrency,
                       num_preemptions=metrics.num_preemptions, recompute_factor=computed_tokens / trace_tokens)


def format_capacity_table(rows: Sequence[CapacityRow]) -> str:
    lines = ["| model | KV dtype | KV bytes / token | max_model_len | contiguous: requests | "
             "paged: peak / mean running | preemptions | tokens computed / needed |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.model} | {row.kv_cache_dtype} | {row.bytes_per_token:,} | {row.max_model_len:,} | "
                     f"{row.contiguous_requests} | {row.paged_peak_requests} / {row.paged_mean_requests:.1f} | "
                     f"{row.num_preemptions} | {row.recompute_factor:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", type=Path, help="config.json files (bench/configs/*.json)")
    parser.add_argument("--kv-cache-bytes", type=parse_size, default=parse_size("16GiB"),
                        help="the KV budget (default 16GiB)")
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["bfloat16", "int8"], choices=sorted(KV_ELEMENT_BYTES))
    parser.add_argument("--num-requests", type=int, default=64, help="documents in the replayed trace")
    args = parser.parse_args(argv)
    rows = []
    for path in args.configs:
        for kv_cache_dtype in args.kv_cache_dtype:
            try:
                facts = facts_from_config(path, kv_cache_dtype)
            except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
                parser.error(f"{path}: {exc}")
            except KeyError as exc:
                parser.error(f"{path}: the config has no {exc}")
            for max_model_len in args.max_model_len:
                if max_model_len > facts.max_position_embeddings:
                    print(f"skipped: {path.stem} max_model_len={max_model_len} is over its context "
                          f"length {facts.max_position_embeddings}")
                    continue
                try:
                    rows.append(capacity_row(facts, args.kv_cache_bytes, max_model_len, args.num_requests))
                except ValueError as exc:
                    print(f"skipped: {path.stem} {kv_cache_dtype} max_model_len={max_model_len}: {exc}")
    print(f"KV budget {format_size(args.kv_cache_bytes)}; {args.num_requests} documents of "
          f"{MIN_DOCUMENT_TOKENS} to max_model_len - {ANSWER_TOKENS} tokens, {ANSWER_TOKENS}-token answers, "
          "all arriving at once; chunks of 2,048 tokens, blocks of 16")
    print(format_capacity_table(rows))
    if not rows:
        print("error: no configuration fits (see the skipped lines above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
