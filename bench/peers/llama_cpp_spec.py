"""Runs in the llama-cpp-python venv: greedy single-stream decode of a GGUF file, with or without
llama.cpp's prompt-lookup decoding, printed as one ``RESULT {json}`` line (``compare.py``'s protocol).

    VENV/bin/python llama_cpp_spec.py --gguf FILE --prompt-json FILE [--max-tokens 256]
        [--threads N] [--prompt-lookup K] [--max-ngram-size 2]

``--prompt-json`` holds ``{"prompt_token_ids": [...]}`` written by ``spec_compare.py``, so llama.cpp
decodes the very prompt pagedllm decodes (the GGUF must share pagedllm's vocabulary).
``--prompt-lookup K`` (0: none) passes ``LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens=K)``
(llama_cpp/llama_speculative.py) as ``draft_model``: each step verifies up to K tokens copied from
the context after the latest n-gram match, in one batch; llama-cpp-python then keeps the logits of
every position (``logits_all``), as its verification needs them.

Greedy (``temp=0, top_k=1``); EOS does not stop ``Llama.generate``, so exactly ``--max-tokens``
tokens come out, as with pagedllm's ``ignore_eos``. Warm-up: the same prompt for 4 tokens
(like bench/spec_decode.py). Decode speed is ``(max_tokens - 1) / (last token - first token)``,
first token to last, as bench/spec_decode.py measures pagedllm.
"""

import argparse
import json
import os
import time


def generate(llm, prompt, max_tokens):
    """Greedy tokens and the time of the first and the last one (perf_counter seconds)."""
    first_at, tokens = None, []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        tokens.append(token)
        if first_at is None:
            first_at = time.perf_counter()
        if len(tokens) == max_tokens:
            break
    return tokens, first_at, time.perf_counter()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompt-json", required=True, help='{"prompt_token_ids": [...]}')
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="K",
                        help="num_pred_tokens of LlamaPromptLookupDecoding (0: no speculation)")
    parser.add_argument("--max-ngram-size", type=int, default=2,
                        help="LlamaPromptLookupDecoding's max_ngram_size (its default 2)")
    parser.add_argument("--n-ctx", type=int, default=0,
                        help="context size (default: prompt + max_tokens + K + 8; with prompt lookup, "
                             "llama-cpp-python keeps n_ctx x vocabulary logits in numpy)")
    args = parser.parse_args()
    if args.max_tokens < 2:
        parser.error(f"--max-tokens must be >= 2 (a decode rate needs two tokens), got {args.max_tokens}")
    from llama_cpp import Llama, __version__
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    prompt = json.loads(open(args.prompt_json).read())["prompt_token_ids"]
    needed = len(prompt) + args.max_tokens + args.prompt_lookup + 8
    if args.n_ctx and args.n_ctx < needed:
        parser.error(f"--n-ctx {args.n_ctx} is below prompt ({len(prompt)}) + --max-tokens + K + 8 = {needed}")
    draft = (LlamaPromptLookupDecoding(max_ngram_size=args.max_ngram_size, num_pred_tokens=args.prompt_lookup)
             if args.prompt_lookup else None)
    start = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=args.n_ctx or needed, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, draft_model=draft, verbose=False)
    startup_s = time.perf_counter() - start
    generate(llm, prompt, 4)
    tokens, first_at, end = generate(llm, prompt, args.max_tokens)
    print("RESULT " + json.dumps({
        "system": f"llama.cpp (llama-cpp-python {__version__})", "gguf": os.path.basename(args.gguf),
        "prompt_lookup": args.prompt_lookup, "max_ngram_size": args.max_ngram_size, "threads": args.threads,
        "startup_s": round(startup_s, 1), "prompt_tokens": len(prompt), "num_tokens": len(tokens),
        "tok_s": round((len(tokens) - 1) / (end - first_at), 2), "token_ids": tokens}), flush=True)


if __name__ == "__main__":
    main()
