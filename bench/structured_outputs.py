"""Per-step cost of structured outputs: decode steps of SmolLM2 at batch 1 and 64, every
request unconstrained vs every request under a JSON schema, in the same process (alternated); plus the
mask work alone (fill + apply) per step.

    .venv/bin/python bench/structured_outputs.py [--batches 1 64] [--steps 16] [--dtype float32]

The schema forces a long string (``minLength``), so no request ends before ``--steps`` decode
steps and both runs time the same batch shapes. Reported: median decode-step time (ms) and the
ratio constrained / unconstrained.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import allocate_bitmask, apply_token_bitmask, fill_bitmasks

SCHEMA = {"type": "object", "required": ["title", "body"],
          "properties": {"title": {"type": "string", "maxLength": 20},
                         "body": {"type": "string", "minLength": 400}}}


def decode_step_times(llm: LLM, batch: int, steps: int, constrained: bool) -> list[float]:
    """Wall times of the decode-only steps of ``batch`` requests (seconds)."""
    engine = llm.llm_engine
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, structured_outputs=so)
    for i in range(batch):
        engine.add_request(f"{constrained}-{batch}-{i}", f"Write article {i} as JSON.", params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        iteration = engine.make_stats().iteration
        if iteration.num_prompt_tokens == 0 and iteration.num_output_tokens == batch:
            times.append(elapsed)
    return times


def mask_ms(llm: LLM, batch: int, steps: int) -> float:
    """Median ms per step of filling and applying ``batch`` masks, states advanced greedily."""
    compiled = llm.llm_engine.grammar_compiler.compile(StructuredOutputsParams(json=SCHEMA))
    states = [compiled.new_state() for _ in range(batch)]
    vocab = llm.llm_engine.model_config.vocab_size
    rows = torch.arange(batch)
    times = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=generator)
        start = time.perf_counter()
        bitmask = allocate_bitmask(batch, vocab)
        fill_bitmasks(states, bitmask)
        apply_token_bitmask(logits, rows, bitmask)
        times.append(time.perf_counter() - start)
        for state, token in zip(states, logits.argmax(dim=-1).tolist()):
            assert state.accept_token(token)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=512, kv_cache_memory_bytes=512 * 2**20, max_num_seqs=64,
              max_num_batched_tokens=2048)
    llm.llm_engine.grammar_compiler.compile(StructuredOutputsParams(json=SCHEMA))  # not a step's cost
    print("| batch | decode step, unconstrained (ms) | decode step, JSON schema (ms) | ratio | "
          "mask fill + apply alone (ms) |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        # Alternated, so that a change in the machine's load hits both alike.
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                times[constrained] += decode_step_times(llm, batch, args.steps, constrained)
        free, constrained = (1000 * statistics.median(times[c]) for c in (False, True))
        print(f"| {batch} | {free:.1f} | {constrained:.1f} | {constrained / free:.2f} | "
              f"{mask_ms(llm, batch, args.steps):.2f} |", flush=True)


if __name__ == "__main__":
    main()
