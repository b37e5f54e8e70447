"""Runs in the llama-cpp-python venv: single-stream decode of a GGUF file, printed as one
``RESULT {json}`` line (the protocol of ``compare.py``).

    VENV/bin/python llama_cpp_single_stream.py --gguf FILE --prompt-json FILE [--new-tokens 128] [--n-ctx 1024] [--flash-attn]

The prompt is given as token ids (pagedllm's tokenizer; a GGUF converted from the same Hugging
Face folder has the same vocabulary). Greedy (``temp=0``), EOS ignored (``Llama.generate`` does
not stop on it). Warm-up: one short, different prompt first, so that no KV prefix is reused.
Time to first token is prompt evaluation plus the first sample; decode speed is the rate of
the remaining ``new_tokens - 1`` tokens, as pagedllm's ``single_stream_pagedllm`` measures it.
"""

import argparse
import json
import os
import time


def generate(llm, prompt, new_tokens):
    start = time.perf_counter()
    first_at, tokens = None, []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        tokens.append(token)
        if first_at is None:
            first_at = time.perf_counter()
        if len(tokens) == new_tokens:
            break
    end = time.perf_counter()
    return first_at - start, (new_tokens - 1) / (end - first_at), tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompt-json", required=True, help='{"prompt_token_ids": [...], "warmup_token_ids": [...]}')
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--n-ctx", type=int, default=1024, help="llama.cpp's context (KV cache) in tokens")
    parser.add_argument("--flash-attn", action="store_true",
                        help="llama.cpp's flash attention (llama-cpp-python's default is off)")
    args = parser.parse_args()
    from llama_cpp import Llama, __version__

    data = json.loads(open(args.prompt_json).read())
    start = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=args.n_ctx, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, flash_attn=args.flash_attn, verbose=False)
    startup_s = time.perf_counter() - start
    generate(llm, data["warmup_token_ids"], 4)
    ttft, rate, tokens = generate(llm, data["prompt_token_ids"], args.new_tokens)
    print("RESULT " + json.dumps({
        "system": f"llama.cpp (llama-cpp-python {__version__})", "gguf": os.path.basename(args.gguf),
        "startup_s": round(startup_s, 1), "threads": args.threads, "flash_attn": args.flash_attn, "single_stream_ttft_s": round(ttft, 4),
        "single_stream_decode_tokens_per_s": round(rate, 2), "check_token_ids": tokens[:64],
        "weight_bytes": os.path.getsize(args.gguf)}), flush=True)


if __name__ == "__main__":
    main()
