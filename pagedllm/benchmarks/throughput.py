"""Offline throughput benchmark (``pagedllm bench throughput``, also ``bench/throughput.py``).

The workload (issue 2): 64 requests whose prompts (32-512 tokens) are cut at seeded random
offsets from public-domain text shipped with the package (``data/public_domain.txt``: the
Declaration of Independence, two Lincoln addresses, Genesis 1 KJV), each generating 32-256
tokens with ``ignore_eos``, greedy. The same workload can run through Hugging Face
``transformers``' own ``generate`` in static batches of 16 (left-padded; every batch runs
until its longest request is done), the "traditional" serving that PagedAttention replaces,
in the same process and the same dtype. Runs of the systems alternate and medians are
reported, since the machine is shared and noisy.

Shape of the workload and of the report follow vLLM's ``benchmarks/benchmark_throughput.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pagedllm.config import EngineArgs
from pagedllm.data import TEXT_PATH

HF_BATCH_SIZE = 16


@dataclass
class BenchRequest:
    """One request of the workload: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass
class BenchResult:
    """Totals of one run over a workload.

    Attributes:
        elapsed_s: wall time of the run in seconds.
        num_requests, prompt_tokens, output_tokens: what was served (only the requested output
            tokens count, never the padding steps of a static batch).
    """

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def line(self, name: str) -> str:
        return (f"{name:>9}: elapsed {self.elapsed_s:7.2f} s, {self.requests_per_s:6.2f} requests/s, "
                f"{self.output_tokens_per_s:8.1f} output tokens/s, "
                f"{self.total_tokens_per_s:8.1f} total tokens/s")


def build_workload(tokenizer, num_requests: int = 64, seed: int = 0,
                   prompt_len_range: tuple[int, int] = (32, 512),
                   output_len_range: tuple[int, int] = (32, 256)) -> list[BenchRequest]:
    """The fixed workload: prompts cut from the shipped text, lengths drawn uniformly (inclusive).

    The text's token stream is read cyclically from a random offset, so any prompt length
    works whatever the text's length.

    Raises:
        ValueError: ``num_requests`` < 1 or a length range with min < 1 or min > max.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    for name, (low, high) in (("prompt_len_range", prompt_len_range),
                              ("output_len_range", output_len_range)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got ({low}, {high})")
    tokens = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_len_range)
        output_len = rng.randint(*output_len_range)
        offset = rng.randrange(len(tokens))
        prompt = [tokens[(offset + i) % len(tokens)] for i in range(prompt_len)]
        workload.append(BenchRequest(prompt, output_len))
    return workload


def _result(workload: list[BenchRequest], elapsed: float) -> BenchResult:
    return BenchResult(elapsed, len(workload), sum(len(r.prompt_token_ids) for r in workload),
                       sum(r.output_len for r in workload))


def run_pagedllm(llm, workload: list[BenchRequest]) -> BenchResult:
    """Serve the whole workload through ``llm.generate`` at once (continuous batching).

    Raises:
        RuntimeError: a request generated a different number of tokens than asked.
    """
    from pagedllm.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for request, output in zip(workload, outputs):
        if len(output.outputs[0].token_ids) != request.output_len:
            raise RuntimeError(f"request {output.request_id} generated "
                               f"{len(output.outputs[0].token_ids)} tokens, expected {request.output_len}")
    return _result(workload, elapsed)


def load_hf_model(model: Optional[str], dtype: torch.dtype):
    """``transformers.LlamaForCausalLM`` over the same (dequantized) weights pagedllm loads."""
    import transformers

    from pagedllm.models.loader import model_folder, resolve_model_path

    folder = str(model_folder(resolve_model_path(model)))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    return hf_model.eval()


@torch.inference_mode()
def hf_generate(hf_model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int) -> torch.Tensor:
    """Greedy ``generate`` on one left-padded static batch, never stopping at EOS.

    Returns:
        ``[batch, max_new_tokens]`` int64 generated ids.
    """
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt):] = 1
    # min_new_tokens == max_new_tokens keeps generate from stopping at EOS, as ignore_eos does.
    out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            pad_token_id=pad_token_id)
    return out[:, longest:]


def run_hf(hf_model, workload: list[BenchRequest], pad_token_id: int,
           batch_size: int = HF_BATCH_SIZE) -> BenchResult:
    """Serve the workload in arrival order in static batches; each runs to its longest request."""
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        hf_generate(hf_model, [r.prompt_token_ids for r in batch], max(r.output_len for r in batch),
                    pad_token_id)
    return _result(workload, time.perf_counter() - start)


def single_stream_pagedllm(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """``(time to first token s, decode tokens/s)`` of one request alone in the engine. The
    first token comes with the step of the prompt's last chunk: a prompt longer than
    ``max_num_batched_tokens`` takes several steps before it."""
    from pagedllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    engine.add_request("single-stream", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    first_token_at = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first_token_at is None and any(o.outputs and o.outputs[0].token_ids for o in outputs):
            first_token_at = time.perf_counter()
    end = time.perf_counter()
    return first_token_at - start, (new_tokens - 1) / (end - first_token_at)


def single_stream_hf(hf_model, prompt: list[int], new_tokens: int, pad_token_id: int) -> tuple[float, float]:
    """``(time to first token s, decode tokens/s)`` of one ``generate`` call, from two calls."""
    start = time.perf_counter()
    hf_generate(hf_model, [prompt], 1, pad_token_id)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(hf_model, [prompt], new_tokens, pad_token_id)
    total = time.perf_counter() - start
    return ttft, (new_tokens - 1) / max(total - ttft, 1e-9)


def _median_result(results: list[BenchResult]) -> BenchResult:
    return BenchResult(statistics.median(r.elapsed_s for r in results), results[0].num_requests,
                       results[0].prompt_tokens, results[0].output_tokens)


def run_benchmark(llm, workload: list[BenchRequest], repeats: int, baseline: Optional[str],
                  model: Optional[str], single_stream: bool, log: Callable[[str], None] = print) -> dict:
    """Alternate pagedllm and the baseline ``repeats`` times; print every run and the medians.

    Returns:
        ``{"pagedllm": BenchResult, "hf": BenchResult or None, "ratio": float or None}`` of medians.
    """
    dtype = llm.llm_engine.model.dtype
    tokenizer = llm.get_tokenizer()
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_model = load_hf_model(model, dtype) if baseline == "hf" else None
    num_prompt = sum(len(r.prompt_token_ids) for r in workload)
    num_output = sum(r.output_len for r in workload)
    log(f"workload: {len(workload)} requests, {num_prompt} prompt tokens, {num_output} output tokens, "
        f"dtype {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads")

    # Warm-up: first calls pay for lazy page faults in the KV pool and one-time kernel setup.
    warm = workload[:2]
    run_pagedllm(llm, [BenchRequest(r.prompt_token_ids, 4) for r in warm])
    if hf_model is not None:
        hf_generate(hf_model, [r.prompt_token_ids for r in warm], 4, pad_token_id)

    ours, theirs = [], []
    for index in range(repeats):
        ours.append(run_pagedllm(llm, workload))
        log(ours[-1].line(f"pagedllm#{index + 1}" if repeats > 1 else "pagedllm"))
        if hf_model is not None:
            theirs.append(run_hf(hf_model, workload, pad_token_id))
            log(theirs[-1].line(f"hf#{index + 1}" if repeats > 1 else "hf"))
    summary = {"pagedllm": _median_result(ours), "hf": None, "ratio": None}
    if repeats > 1:
        log(summary["pagedllm"].line("pagedllm median"))
    if theirs:
        summary["hf"] = _median_result(theirs)
        if repeats > 1:
            log(summary["hf"].line("hf median"))
        summary["ratio"] = summary["pagedllm"].output_tokens_per_s / summary["hf"].output_tokens_per_s
        log(f"throughput ratio pagedllm / hf (output tokens/s, medians): {summary['ratio']:.2f}x")

    if single_stream:
        tokens = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
        prompt = tokens[:256]
        for index in range(repeats):
            ttft, rate = single_stream_pagedllm(llm, prompt, 128)
            log(f"single stream pagedllm: 256-token prompt, time to first token {ttft * 1000:.0f} ms, "
                f"decode {rate:.1f} tokens/s")
            if hf_model is not None:
                ttft, rate = single_stream_hf(hf_model, prompt, 128, pad_token_id)
                log(f"single stream hf:       256-token prompt, time to first token {ttft * 1000:.0f} ms, "
                    f"decode {rate:.1f} tokens/s")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options (engine options are added by the CLI)."""
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default 64)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the workload's lengths and offsets")
    parser.add_argument("--baseline", choices=["hf"], default=None,
                        help="also run the workload through transformers' generate in static "
                             "batches of 16 and print the throughput ratio")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the systems this many times and report medians (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both systems (default: torch's, one per core)")
    parser.add_argument("--no-single-stream", dest="single_stream", action="store_false",
                        help="skip the single-stream decode measurement (256-token prompt, 128 new tokens)")


def main(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Run the benchmark from parsed CLI arguments.

    Raises:
        ValueError: ``--repeats`` < 1 or an invalid workload/engine option.
    """
    from pagedllm.llm import LLM

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    llm = LLM(**dataclasses.asdict(engine_args))
    workload = build_workload(llm.get_tokenizer(), args.num_requests, args.workload_seed)
    run_benchmark(llm, workload, args.repeats, args.baseline, engine_args.model, args.single_stream)
    return 0
