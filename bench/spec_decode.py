"""Speculative decoding: single-stream decode speed with and without drafts, and the batch size
where it stops paying (docs/speculative-decoding.md).

Two workloads, each on its own model, loaded once and shared by one engine per configuration
(no speculation, ``ngram``, ``suffix``, ``draft_model``); the configurations run one after the
other, round after round, so that a change in the machine's load hits them alike:

- code edit: Qwen2.5-Coder-0.5B-Instruct rewrites a given function (the answer copies most
  of it);
- summary with quotations: SmolLM2-135M-Instruct summarizes a passage quoting it verbatim.

``draft_model`` drafts with ``--draft-model`` (default: the workload's own model) quantized as
``--draft-quantization`` (default ``int4``: the GGUF's 4-bit codes), so by default each model
drafts for itself through its int4 variant.

Each run decodes the greedy answer: as many tokens as the non-speculative answer has up to its
EOS (``--max-tokens`` N: N tokens, EOS ignored; past its answer a model writes text that has
nothing to do with the prompt, which no proposer can draft).

Per configuration it prints the acceptance rate (accepted / draft tokens), output tokens per
decode step, decode tokens per second (first token to last, so prefill is left out) and the
speed-up over no speculation, and whether the greedy output equals the non-speculative one.
``--batch-sizes`` adds the crossover: decode tokens per second of B copies of the code-edit
request at once, without speculation and with ``ngram`` drafts in every step
(``disable_by_batch_size`` off).

    python bench/spec_decode.py                       # both workloads, 3 rounds
    python bench/spec_decode.py --batch-sizes 1 2 4 8 16
    python bench/spec_decode.py --rounds 1 --max-tokens 16 --workloads summary   # smoke run
    python bench/spec_decode.py --configs none draft_model ngram --rounds 3       # the draft model
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

_FUNCTION = '''def parse_config(path, defaults=None, strict=False):
    result = dict(defaults or {})
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                if strict:
                    raise ValueError("line %d: expected key = value" % number)
                continue
            key, value = line.split("=", 1)
            key = key.strip().lower()
            value = value.strip()
            if value.lower() in ("true", "yes", "on"):
                value = True
            elif value.lower() in ("false", "no", "off"):
                value = False
            elif value.isdigit():
                value = int(value)
            result[key] = value
    return result
'''

_PASSAGE = (
    "The city council met on Tuesday to discuss the future of the old railway station. "
    "The mayor opened the meeting by saying that \"the station has stood empty for eleven years, "
    "and every year it stands empty it costs us more to save it.\" Engineers presented a report "
    "which found that the roof needs urgent repair but that the brick walls are sound. "
    "A group of residents proposed turning the building into a public library and market hall. "
    "Their spokesperson, a retired teacher, told the council that \"a town without a place to "
    "gather is only a collection of houses.\" Two councillors argued that the land should be sold "
    "to a developer, because the sale would pay for new roads on the east side. After three hours "
    "the council voted six to three to repair the roof this year and to ask the residents' group "
    "for a detailed plan by the spring. The mayor closed the meeting by promising that \"no decision "
    "about the station will be made without asking the people who use it.\"")

WORKLOADS = {
    "code-edit": ("qwen2.5-coder-0.5b",
                  "Rewrite this Python function with type hints and a docstring. Keep the code and "
                  "the names exactly as they are otherwise. Reply with the code only.\n\n```python\n"
                  + _FUNCTION + "```"),
    "summary": ("smollm2-135m",
                "Summarize the following article in a few sentences, quoting the most important "
                "sentences word for word in quotation marks.\n\n" + _PASSAGE),
}

CONFIGS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix"},  # vLLM's default bound: the trie's depth (24)
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 5},
}


def build_prompt(tokenizer, text: str) -> list[int]:
    """The workload's prompt token ids: ``text`` as one user turn in the model's chat template,
    with the assistant's generation prompt (bench/peers/spec_compare.py sends the same ids)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                           add_generation_prompt=True)
    return list(getattr(prompt, "input_ids", prompt))


def make_engine(base: LLMEngine, config, batch_size: int = 1) -> LLMEngine:
    """An engine over ``base``'s loaded model and tokenizer with ``speculative_config=config``."""
    if config is not None and batch_size > 1:
        config = dict(config, disable_by_batch_size=None)
    args = EngineArgs.from_kwargs(model=base.args.model, dtype=base.args.dtype,
                                  kv_cache_memory_bytes=256 * 2**20, max_model_len=2048,
                                  speculative_config=config)
    return LLMEngine(args, model=base.model, tokenizer=base.tokenizer)


def answer_length(engine: LLMEngine, prompt_token_ids: list[int], limit: int = 1024) -> int:
    """Tokens of the greedy answer to the prompt, its EOS included (at most ``limit``): how many
    tokens a run decodes when ``--max-tokens`` is 0."""
    return len(run_once(engine, prompt_token_ids, limit, ignore_eos=False)["tokens"])


def run_once(engine: LLMEngine, prompt_token_ids: list[int], max_tokens: int, batch_size: int = 1,
             ignore_eos: bool = True) -> dict:
    """Generate greedily for ``batch_size`` copies of the prompt; time from the step that gave
    the first tokens to the last step."""
    stats_before = engine.make_stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    for i in range(batch_size):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt_token_ids}, params)
    first_token_time = None
    num_decode_steps = 0
    outputs = {}
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        now = time.perf_counter()
        if first_token_time is None and any(o.outputs and o.outputs[0].token_ids for o in step_outputs):
            first_token_time = now
        elif first_token_time is not None:
            num_decode_steps += 1
        for output in step_outputs:
            outputs[output.request_id] = output
    end = now
    stats = engine.make_stats()
    token_ids = [o.outputs[0].token_ids for o in outputs.values()]
    num_decoded = sum(len(t) - 1 for t in token_ids)
    drafts = stats.spec_decode_num_draft_tokens - stats_before.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - stats_before.spec_decode_num_accepted_tokens
    return {"tok_s": num_decoded / (end - first_token_time), "tokens": token_ids[0],
            "tokens_per_step": num_decoded / batch_size / max(1, num_decode_steps),
            "acceptance": accepted / drafts if drafts else float("nan")}


def bench_workload(name: str, args: argparse.Namespace) -> None:
    model, text = WORKLOADS[name]
    base = LLMEngine(EngineArgs.from_kwargs(model=model, dtype=args.dtype, kv_cache_memory_bytes=64 * 2**20,
                                            max_model_len=2048))
    tokenizer = base.tokenizer
    prompt = build_prompt(tokenizer, text)
    draft = {"model": args.draft_model or model, "quantization": args.draft_quantization or None}
    engines = {config: make_engine(base, dict(CONFIGS[config], **draft) if config == "draft_model" else CONFIGS[config])
               for config in args.configs}
    for engine in engines.values():  # warm-up: C++ ops, first-touch of the KV pool
        run_once(engine, prompt, 4)
    max_tokens = args.max_tokens or answer_length(engines[args.configs[0]], prompt)
    results = {config: [] for config in engines}
    for _ in range(args.rounds):
        for config, engine in engines.items():
            results[config].append(run_once(engine, prompt, max_tokens))
    reference = results[args.configs[0]][0]
    baseline = statistics.median(r["tok_s"] for r in results[args.configs[0]])
    print(f"\n## {name}: {model}, {len(prompt)}-token prompt, {max_tokens} tokens"
          f"{'' if args.max_tokens else ' (the answer, to its EOS)'}, greedy, "
          f"median of {args.rounds} alternated rounds")
    print(f"answer: {tokenizer.decode(reference['tokens'])!r}")
    if "draft_model" in engines:
        print(f"draft_model: {draft['model']}, quantization {draft['quantization'] or 'as its checkpoint'}")
    print("| config | acceptance rate | tokens per step | decode tok/s | speed-up | output equals first config |")
    print("|---|---|---|---|---|---|")
    for config, runs in results.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        print(f"| {config} | {statistics.median(r['acceptance'] for r in runs):.2f} | "
              f"{statistics.median(r['tokens_per_step'] for r in runs):.2f} | {tok_s:.1f} | "
              f"{tok_s / baseline:.2f}x | {all(r['tokens'] == reference['tokens'] for r in runs)} |")
    if args.batch_sizes:
        print(f"\n### crossover ({name}): B copies of the request at once, decode tok/s of all together")
        print("| batch | none tok/s | ngram tok/s (every step) | ngram / none |")
        print("|---|---|---|---|")
        for batch_size in args.batch_sizes:
            pair = {config: make_engine(base, CONFIGS[config], batch_size) for config in ("none", "ngram")}
            speeds = {config: [] for config in pair}
            for _ in range(args.rounds):
                for config, engine in pair.items():
                    speeds[config].append(run_once(engine, prompt, max_tokens, batch_size)["tok_s"])
            none, ngram = (statistics.median(speeds[c]) for c in ("none", "ngram"))
            print(f"| {batch_size} | {none:.1f} | {ngram:.1f} | {ngram / none:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["code-edit", "summary"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="the first is the baseline of the speed-up")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="tokens decoded per run; 0 (default): the greedy answer's length, to its EOS")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="ngram and draft_model: default 5; suffix: default the trie's depth (vLLM's rule)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram (prompt_lookup_max: 5 or this)")
    parser.add_argument("--draft-model", default=None,
                        help="draft_model: the draft (default: the workload's model itself)")
    parser.add_argument("--draft-quantization", default="int4",
                        help="draft_model: the draft's quantization ('' for none; default int4)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 gives steadier ratios on a shared machine")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                        help="crossover: batch sizes to run (code-edit only when both workloads run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    k = args.num_speculative_tokens
    CONFIGS["ngram"].update(num_speculative_tokens=k or 5, prompt_lookup_min=args.prompt_lookup_min,
                            prompt_lookup_max=max(5, args.prompt_lookup_min))
    CONFIGS["draft_model"].update(num_speculative_tokens=k or 5)
    if k:
        CONFIGS["suffix"].update(num_speculative_tokens=k)
    for index, name in enumerate(args.workloads):
        if index and args.batch_sizes:
            args.batch_sizes = []  # the crossover once, on the first workload
        bench_workload(name, args)


if __name__ == "__main__":
    main()
