"""``pagedllm plan``: load a trace and a cost model (or calibrate one), sweep, report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from pagedllm.planner.cost_model import CostModel, calibrate
from pagedllm.planner.sweep import (SweepSpace, build_configs, default_max_model_lens, format_table,
                                    parse_size, recommend, rejection_lines, run_sweep, write_plots)
from pagedllm.planner.trace import load_trace

CALIBRATION_KV_BYTES = 256 * 2**20  # enough for the profile's 48 x 400-token batch, small on any machine
DEFAULT_BUDGETS = 6  # KV budgets swept without --memory (default_budgets)


def _list(convert: Callable[[str], object], name: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        values = []
        for part in text.split(","):
            try:
                values.append(convert(part.strip()))
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{name}: {exc}") from None
        return values
    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be an integer >= 1, got {value}")
    return value


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"must be on or off, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pagedllm plan``. Sweep options take comma-separated lists; every
    combination is replayed."""
    parser.add_argument("--trace", required=True, type=Path,
                        help="JSONL trace, one request per line (the format of `pagedllm serve --request-log`)")
    parser.add_argument("--memory", type=_list(parse_size, "--memory"), default=None,
                        help="KV cache budgets to try, e.g. 1GiB,4GiB (default: 6 from the smallest that holds "
                             "the trace's longest request to what the engine would take on the calibrating "
                             "machine, spaced geometrically)")
    parser.add_argument("--max-model-len", type=_list(_positive_int, "--max-model-len"), default=None,
                        help="values to try (default: the engine's default and the smallest power of two "
                             "holding 99%% of the trace's requests)")
    parser.add_argument("--max-num-seqs", type=_list(_positive_int, "--max-num-seqs"), default=[256],
                        help="values to try (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=_list(_positive_int, "--max-num-batched-tokens"),
                        default=[2048], help="values to try (default 2048)")
    parser.add_argument("--block-size", type=_list(_positive_int, "--block-size"), default=[16],
                        help="values to try (default 16)")
    parser.add_argument("--prefix-caching", type=_list(_on_off, "--prefix-caching"), default=[True, False],
                        help="on, off or on,off (default on,off)")
    parser.add_argument("--cost-model", type=Path, default=None,
                        help="step-time model (JSON): read if it exists, else calibrated now and written "
                             "there (default: a file per model in the pagedllm cache, reused)")
    parser.add_argument("--recalibrate", action="store_true", help="measure the cost model again even if saved")
    parser.add_argument("--model", default=None, help="the model whose step times are calibrated and whose "
                                                      "tokenizer reads text prompts (default: SmolLM2)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: calibrate on random weights of --model's config.json (as `serve`)")
    parser.add_argument("--dtype", default="auto", help="compute dtype of the calibration (as `serve`)")
    parser.add_argument("--quantization", default=None, help="quantization of the calibration (as `serve`)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (as `serve`)")
    parser.add_argument("--plot-dir", type=Path, default=None,
                        help="write concurrency.png, kv_usage.png and latency_cdf.png of the recommended "
                             "configuration here (needs matplotlib: pip install 'pagedllm[plot]')")


def default_cost_model_path(args: argparse.Namespace) -> Path:
    import torch

    from pagedllm.models.loader import cache_dir

    name = Path(args.model).stem if args.model else "default"
    key = f"{name}-{args.dtype}-{args.quantization or 'none'}-{args.kv_cache_dtype}-{torch.get_num_threads()}t"
    return cache_dir() / "planner" / f"cost-model-{key}.json"


def default_budgets(default_bytes: int, trace, cost_model: CostModel, block_sizes: list[int]) -> list[int]:
    """The KV budgets (bytes) swept without ``--memory``: ``DEFAULT_BUDGETS`` spaced
    geometrically from the smallest that holds the trace's longest request (prompt + output
    tokens, in the smallest block size swept) up to ``default_bytes``, the engine's default on
    the calibrating machine; the default alone if it is not above that smallest one. With the
    default alone, a trace that needs a few blocks was recommended the whole 20 GiB default."""
    block_size = min(block_sizes)
    longest = max(request.num_tokens for request in trace)
    smallest = -(-longest // block_size) * cost_model.facts.bytes_per_block(block_size)
    if default_bytes <= smallest:
        return [default_bytes]
    ratio = (default_bytes / smallest) ** (1 / (DEFAULT_BUDGETS - 1))
    return sorted({round(smallest * ratio**i) for i in range(DEFAULT_BUDGETS - 1)} | {default_bytes})


def calibrate_model(args: argparse.Namespace, log: Callable[[str], None]) -> CostModel:
    """Load the model, measure its step times (~100 steps; 80 s on 2 shared cores) and the KV
    budget the engine would take by default here."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.worker.kv_cache_sizing import bytes_per_block, determine_num_blocks

    log("calibrating the cost model: loading the model and timing ~100 steps")
    common = dict(model=args.model, dtype=args.dtype, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, load_format=args.load_format)
    engine = LLMEngine(EngineArgs.from_kwargs(**common, kv_cache_memory_bytes=CALIBRATION_KV_BYTES,
                                              enable_prefix_caching=False, max_num_seqs=64))
    default_args = EngineArgs.from_kwargs(**common)
    num_blocks = determine_num_blocks(engine.model, default_args, engine.kv_cache_dtype)
    default_bytes = num_blocks * bytes_per_block(engine.model, default_args.block_size, engine.kv_cache_dtype)
    return calibrate(engine, default_kv_cache_bytes=default_bytes, log=log)


def main(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    """Run ``pagedllm plan`` from parsed arguments; the report goes to stdout.

    Raises:
        ValueError: a bad trace, cost model or option, or a sweep where every configuration is
            refused.
    """
    path = args.cost_model or default_cost_model_path(args)
    if path.exists() and not args.recalibrate:
        cost_model = CostModel.load(path)
        log(f"cost model: {path}")
    else:
        # The trace's form first, not after minutes of calibration (token ids against the
        # vocabulary, and text through the tokenizer, are checked once the model is known).
        load_trace(args.trace, sys.maxsize, lambda text: [0])
        cost_model = calibrate_model(args, log)
        cost_model.save(path)
        log(f"cost model saved to {path} (reused by later runs; --recalibrate measures again)")
    facts = cost_model.facts

    tokenizer: list = []

    def encode(text: str) -> list[int]:
        if not tokenizer:
            if args.load_format == "dummy":
                raise ValueError("the trace has text prompts, and a --load-format dummy model has no tokenizer: "
                                 "give the trace's prompts as token ids")
            from pagedllm.models.loader import load_tokenizer, resolve_model_path
            tokenizer.append(load_tokenizer(resolve_model_path(args.model)))
        return tokenizer[0].encode(text)

    trace = load_trace(args.trace, facts.vocab_size, encode)
    budgets = args.memory
    if not budgets:
        if not facts.default_kv_cache_bytes:
            raise ValueError("the cost model has no default KV budget: give --memory")
        budgets = default_budgets(facts.default_kv_cache_bytes, trace, cost_model, args.block_size)
    space = SweepSpace(kv_cache_bytes=budgets, max_model_lens=args.max_model_len or default_max_model_lens(trace),
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       block_sizes=args.block_size, prefix_caching=list(dict.fromkeys(args.prefix_caching)))
    built = build_configs(space, cost_model)
    for _, why in built:
        if why:
            log(f"skipped: {why}")
    configs = [config for config, _ in built if config is not None]
    if not configs:
        raise ValueError("every configuration of the sweep is refused by the engine (see above)")
    num_prompt = sum(r.num_prompt_tokens for r in trace)
    num_output = sum(r.output_tokens for r in trace)
    calibration = cost_model.calibration
    log(f"trace: {len(trace)} requests over {trace[-1].arrival_time - trace[0].arrival_time:.1f} s, "
        f"{num_prompt} prompt tokens, {num_output} output tokens, longest {max(r.num_tokens for r in trace)} tokens")
    log(f"model: {facts.model or 'default'} ({facts.dtype}, KV {facts.kv_cache_dtype}, "
        f"{facts.bytes_per_block(16) // 16} bytes per token); step times calibrated on "
        f"{calibration.get('cpu', 'an unknown CPU')} (torch threads: {calibration.get('threads', '?')})")
    rows = run_sweep(trace, configs, cost_model)
    chosen, paragraph = recommend(rows)
    log("")
    log(format_table(rows, chosen))
    log("columns: conc = running requests, peak blk = most KV blocks in use, queue = arrival to first "
        "schedule, waste = empty share of reserved KV slots (paged / contiguous max_model_len / contiguous "
        "prompt+max_tokens), pfx saved = prompt tokens found in the prefix cache")
    log("")
    log(paragraph)
    if rows[chosen].result.rejected:
        log(f"requests configuration {chosen + 1} refuses as never fitting:")
        for line in rejection_lines(rows[chosen]):
            log(line)
    if args.plot_dir is not None:
        try:
            paths = write_plots(rows[chosen], args.plot_dir)
        except ImportError:
            log("plots skipped: matplotlib is not installed (pip install 'pagedllm[plot]')")
        else:
            log("plots: " + ", ".join(str(p) for p in paths))
    return 0

