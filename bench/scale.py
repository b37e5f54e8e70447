"""pagedllm at the sizes people serve: a model built from a config.json (``load_format="dummy"``:
random weights of the real shapes, quantized as asked) measured on the workload of issue 38.

    python bench/scale.py --config bench/configs/Llama-3.1-8B-Instruct.json [--quantization int4]

- offline throughput: ``--num-requests`` prompts of ``--prompt-len`` random token ids, each
  generating ``--output-len`` tokens (greedy, EOS ignored), all through ``LLM.generate``;
- for each ``--contexts`` length (default 1k, 16k, 32k; those over the model's context length
  are skipped): one prompt alone in the engine, its time to first token (every prefill chunk)
  and its single-stream decode rate over ``--decode-tokens`` tokens at that context;
- ``--cached-document N``: two questions about one N-token document, one after the other; the
  second's time to first token, with the document's blocks from the prefix cache, against the
  first's.

Each run builds its engine once and warms it with a short request. The KV pool is sized to
the largest run (``num_gpu_blocks_override``), so no run is cut by the machine's memory and
none preempts. Prompts are random ids, so nothing but the cached document is served from the
prefix cache. Weights are random: output text is meaningless, the work is the real model's.
Check the machine has room: the weights (``dtype`` bytes per parameter, or the quantized size)
plus the KV pool.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.throughput import single_stream_pagedllm
from pagedllm.platform import process_rss_bytes
from pagedllm.utils import cdiv

BLOCK_SIZE = 16


def _prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def single_stream(llm: LLM, prompt: list[int], decode_tokens: int) -> dict:
    """One request alone in the engine (``single_stream_pagedllm``): ``ttft_s`` (every prefill
    chunk, until its first token), the prefill rate, and the decode rate after the first token."""
    ttft, decode_rate = single_stream_pagedllm(llm, prompt, decode_tokens)
    return {"context": len(prompt), "ttft_s": ttft, "prefill_tokens_per_s": len(prompt) / ttft,
            "decode_tokens_per_s": decode_rate}


def cached_document(llm: LLM, document_len: int, question_len: int, vocab_size: int, decode_tokens: int) -> dict:
    """The long-document QA case: a ``document_len``-token document and a ``question_len``-token
    question, alone in the engine, then the same document with another question. Returns both
    times to first token (s), the first over the second, and the second request's prefix-cache
    hits (tokens whose K/V it found instead of computing)."""
    document = _prompt(document_len, vocab_size, 2000)
    manager = llm.llm_engine.kv_cache_manager
    first = single_stream(llm, document + _prompt(question_len, vocab_size, 2001), decode_tokens)
    hits_before = manager.prefix_cache_hits
    second = single_stream(llm, document + _prompt(question_len, vocab_size, 2002), decode_tokens)
    return {"document": document_len, "question": question_len, "first_ttft_s": first["ttft_s"],
            "second_ttft_s": second["ttft_s"], "speedup": first["ttft_s"] / second["ttft_s"],
            "second_hit_tokens": manager.prefix_cache_hits - hits_before}


def offline_throughput(llm: LLM, num_requests: int, prompt_len: int, output_len: int, vocab_size: int) -> dict:
    prompts = [{"prompt_token_ids": _prompt(prompt_len, vocab_size, seed)} for seed in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != num_requests * output_len:
        raise RuntimeError(f"generated {generated} tokens, expected {num_requests * output_len}")
    return {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len, "elapsed_s": elapsed,
            "output_tokens_per_s": generated / elapsed,
            "total_tokens_per_s": (generated + num_requests * prompt_len) / elapsed}


def build_llm(args: argparse.Namespace, max_model_len: int, num_blocks: int) -> LLM:
    return LLM(model=str(args.config), load_format="dummy", dtype=args.dtype, quantization=args.quantization,
               kv_cache_dtype=args.kv_cache_dtype, max_model_len=max_model_len, block_size=BLOCK_SIZE,
               num_gpu_blocks_override=num_blocks, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine options (also bench/roofline.py's)."""
    parser.add_argument("--config", type=Path, required=True, help="a config.json (bench/configs/*.json)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="int8, int4, w8a8 or w4a8 (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated by each single stream")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 32768],
                        help="single-stream prompt lengths (TTFT, then decode at that context)")
    parser.add_argument("--num-requests", type=int, default=32, help="offline throughput requests (0: skip)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cached-document", type=int, default=0, metavar="TOKENS",
                        help="also time two questions (--question-len tokens each) about one document of "
                             "TOKENS tokens, the second served from the prefix cache (0: skip)")
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> dict:
    """Build the engine once, run the throughput and single-stream measurements, return them."""
    raw = json.loads(args.config.read_text())
    context_length = raw.get("max_position_embeddings", 2048)
    contexts = [c for c in args.contexts if c + args.decode_tokens <= context_length]
    for skipped in sorted(set(args.contexts) - set(contexts)):
        print(f"skipped: context {skipped} + {args.decode_tokens} tokens is over the model's {context_length}")
    document = args.cached_document + args.question_len + args.decode_tokens if args.cached_document else 0
    if document > context_length:
        raise ValueError(f"--cached-document {args.cached_document} + --question-len {args.question_len} + "
                         f"--decode-tokens {args.decode_tokens} is over the model's {context_length}")
    longest = max([c + args.decode_tokens for c in contexts] + [args.prompt_len + args.output_len, document])
    throughput_tokens = args.num_requests * cdiv(args.prompt_len + args.output_len, BLOCK_SIZE) * BLOCK_SIZE
    # The document's blocks stay cached (freed but not evicted) beside the second question's.
    num_blocks = max(cdiv(longest, BLOCK_SIZE) + cdiv(document, BLOCK_SIZE), cdiv(throughput_tokens, BLOCK_SIZE)) + 1
    start = time.perf_counter()
    llm = build_llm(args, longest, num_blocks)
    engine = llm.llm_engine
    vocab_size = engine.model_config.vocab_size
    results: dict = {"config": str(args.config), "dtype": str(engine.model.dtype).replace("torch.", ""),
                     "quantization": args.quantization,
                     "kv_cache_dtype": str(engine.kv_cache_dtype).replace("torch.", ""),
                     "weight_bytes": engine.weight_bytes, "kv_pool_bytes": engine.num_blocks * engine.bytes_per_block,
                     "build_s": time.perf_counter() - start, "threads": torch.get_num_threads()}
    print(f"built {args.config.stem} in {results['build_s']:.1f} s: weights {engine.weight_bytes / 2**30:.2f} GiB "
          f"({results['dtype']}, quantization {args.quantization}), KV pool {results['kv_pool_bytes'] / 2**30:.2f} GiB "
          f"({results['kv_cache_dtype']}), process {process_rss_bytes() / 2**30:.2f} GiB")
    single_stream(llm, _prompt(min(64, longest - 8), vocab_size, 999), 4)  # warm-up
    if args.num_requests:
        results["throughput"] = offline_throughput(llm, args.num_requests, args.prompt_len, args.output_len,
                                                   vocab_size)
        t = results["throughput"]
        print(f"offline: {t['num_requests']} x ({t['prompt_len']} + {t['output_len']}) tokens in "
              f"{t['elapsed_s']:.1f} s: {t['output_tokens_per_s']:.1f} output tok/s, "
              f"{t['total_tokens_per_s']:.1f} total tok/s")
    results["single_stream"] = []
    for index, context in enumerate(contexts):
        row = single_stream(llm, _prompt(context, vocab_size, 1000 + index), args.decode_tokens)
        results["single_stream"].append(row)
        print(f"context {context:>6}: TTFT {row['ttft_s']:.2f} s ({row['prefill_tokens_per_s']:.0f} prefill tok/s), "
              f"decode {row['decode_tokens_per_s']:.2f} tok/s")
    if args.cached_document:
        row = results["cached_document"] = cached_document(llm, args.cached_document, args.question_len, vocab_size,
                                                           args.decode_tokens)
        print(f"document {row['document']} + question {row['question']} tokens: TTFT {row['first_ttft_s']:.2f} s, "
              f"then {row['second_ttft_s']:.3f} s for another question ({row['speedup']:.0f}x sooner; "
              f"{row['second_hit_tokens']} tokens from the prefix cache)")
    results["peak_process_bytes"] = process_rss_bytes()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args())
