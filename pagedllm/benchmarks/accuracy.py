"""Accuracy of quantized weights (``pagedllm bench accuracy``, also ``bench/accuracy.py``).

For each model and each ``quantization`` (``--methods``; default None, ``int8``, ``int4``,
``w8a8``, ``w4a8``) in one process:

- perplexity on the public-domain text the package ships (``data/public_domain.txt``), from
  the engine's own prompt logprobs: ``exp(-mean log p(token_i | tokens_<i))`` over the first
  ``--num-tokens`` tokens, one request (the first token has no logprob);
- greedy agreement with the unquantized run on the first 16 prompts of the throughput
  workload (``throughput.build_workload``): the share of output positions with the same token;
- weight memory and the KV blocks that a fixed budget (``--memory-budget-mib``, weights + KV)
  buys with those weights.

The unquantized baseline uses the engine's ``dtype`` (``auto``: bf16 on CPUs with bf16
units, fp32 elsewhere); every run uses the engine's ``kv_cache_dtype`` (``--kv-cache-dtype``).
"""

from __future__ import annotations

import argparse
import gc
import math
from typing import Optional

from pagedllm.benchmarks.throughput import TEXT_PATH, build_workload
from pagedllm.config import EngineArgs

METHODS = (None, "int8", "int4", "w8a8", "w4a8")


def shipped_text_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of the shipped text (BOS not added).

    Raises:
        ValueError: the text has fewer than ``num_tokens`` tokens, or ``num_tokens`` < 2.
    """
    tokens = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    if not 2 <= num_tokens <= len(tokens):
        raise ValueError(f"num_tokens must be in [2, {len(tokens)}] (the shipped text's length), got {num_tokens}")
    return tokens[:num_tokens]


def perplexity(llm, token_ids: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``token_ids[1:]``, from prompt logprobs.

    Raises:
        ValueError: ``token_ids`` does not fit ``max_model_len`` (with one generated token).
    """
    from pagedllm.sampling_params import SamplingParams

    output = llm.generate({"prompt_token_ids": token_ids},
                          SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)[0]
    logprobs = [entry[token].logprob for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_outputs(llm, num_prompts: int = 16, max_tokens: int = 32) -> list[list[int]]:
    """Greedy tokens for the first ``num_prompts`` prompts of the throughput workload."""
    from pagedllm.sampling_params import SamplingParams

    workload = build_workload(llm.get_tokenizer())[:num_prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions (over all requests) where ``outputs`` has ``reference``'s token."""
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    return same / sum(len(ref) for ref in reference)


def evaluate(model: Optional[str], dtype: str, num_tokens: int, budget_bytes: int,
             kv_cache_dtype: str = "auto", methods: tuple[Optional[str], ...] = METHODS) -> list[dict]:
    """One row per quantization method (``methods``, None for unquantized) for ``model``; the
    first method's greedy outputs are the reference of the agreement column. See the module
    docstring."""
    from pagedllm.llm import LLM

    rows, reference = [], None
    for method in methods:
        llm = LLM(model=model, dtype=dtype, quantization=method, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_memory_bytes=256 * 2**20,
                  max_model_len=max(1024, num_tokens + 1), enable_prefix_caching=False)
        engine = llm.llm_engine
        block_bytes = engine.bytes_per_block
        ppl = perplexity(llm, shipped_text_token_ids(llm.get_tokenizer(), num_tokens))
        greedy = greedy_outputs(llm)
        reference = greedy if reference is None else reference
        rows.append(dict(model=model or "smollm2-135m", quantization=method or "none",
                         dtype=f"{engine.model.dtype}/{engine.kv_cache_dtype}".replace("torch.", ""),
                         perplexity=ppl, agreement=agreement(greedy, reference),
                         weight_mib=engine.weight_bytes / 2**20,
                         kv_blocks=max(0, (budget_bytes - engine.weight_bytes) // block_bytes)))
        del llm, engine
        gc.collect()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"],
                        help="named models, GGUF files or folders (default: smollm2-135m)")
    parser.add_argument("--num-tokens", type=int, default=2048,
                        help="tokens of the shipped text scored for perplexity (default 2048)")
    parser.add_argument("--memory-budget-mib", type=int, default=1024,
                        help="weights + KV budget for the KV-blocks column (default 1024 MiB)")
    parser.add_argument("--methods", nargs="+", default=[m or "none" for m in METHODS],
                        choices=[m or "none" for m in METHODS],
                        help="quantizations to run, in order; the first is the reference of the ratio and "
                             "agreement columns (default: all, none first)")


def main(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    budget = args.memory_budget_mib * 2**20
    header = f"{'model':<22} {'quant':<6} {'dtype/kv cache':<17} {'ppl':>8} {'ppl ratio':>9} {'greedy agree':>12} " \
             f"{'weights MiB':>11} {'KV blocks':>9}"
    print(header)
    for model in args.models:
        methods = tuple(None if m == "none" else m for m in args.methods)
        rows = evaluate(model, engine_args.dtype, args.num_tokens, budget, engine_args.kv_cache_dtype, methods)
        for row in rows:
            print(f"{row['model']:<22} {row['quantization']:<6} {row['dtype']:<17} {row['perplexity']:>8.3f} "
                  f"{row['perplexity'] / rows[0]['perplexity']:>9.3f} {row['agreement']:>12.3f} "
                  f"{row['weight_mib']:>11.1f} {row['kv_blocks']:>9}", flush=True)
    return 0
