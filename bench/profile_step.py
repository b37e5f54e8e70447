"""Where one engine step spends its time: a decode step and a prefill step at batch 1, 16, 64.

    .venv/bin/python bench/profile_step.py [--dtype float32] [--context 300] [--repeats 5]
    # a model without its weights, and the last 2,048-token chunk of a 32k-token prompt:
    .venv/bin/python bench/profile_step.py --config bench/configs/Llama-3.2-3B-Instruct.json \
        --dtype bfloat16 --batches 1 --context 1024 --prefill-context 30720 --prefill-tokens 2048

Decode at batch B: B sequences each with ``--context`` tokens in the KV cache compute one
token. Prefill at batch B: B prompts of ``min(512, 2048 // B)`` tokens each (one step of the
default 2048-token budget), or of ``--prefill-tokens`` each after ``--prefill-context`` cached
tokens (a later chunk of a chunked prefill). The KV contents are zeros: attention costs depend
on lengths only. The pool is faulted in at start (``warm_kv_cache``): never-written pages
would all map the kernel's one zero page, and a long-context decode would read it from
cache instead of its blocks from DRAM (32k-token 3B w8a8 decode on Zen 4, before 16c2183:
194 ms a step so, where the engine after a real prompt took 427).
Every step is timed without the profiler (median of ``--repeats``), then once under
``torch.profiler`` to split its time into categories of ATen ops; "python + other" is the
step's wall time that no ATen op accounts for (list building, tensor creation, dispatch).
With ``--paired N``, each batch-1 decode is also timed N times, each step beside a read of
the bytes it reads (its weight storages and its sequence's KV blocks, ``bench/roofline.py``'s
``paired_fractions``): the step's rate as a fraction of the read's a moment later.
The results are written into bench/README.md by hand.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduled_batch import SamplingInput, ScheduledBatch, ScheduledRequest

import roofline  # bench/roofline.py, beside this file

CATEGORIES = [
    # decode_layers calls its ops directly (not through the dispatcher): only the linear layers
    # inside it (mkldnn, _int_mm) show up apart; the rest of each layer is this op's own time.
    ("decode_layers op (norms, rope, attention, kv write)", ("pagedllm::decode_layers",)),
    ("attention (decode kernel)", ("pagedllm::paged_decode_attention",)),
    ("attention (sdpa)", ("aten::scaled_dot_product", "aten::_scaled_dot_product")),
    ("kv write + gathers", ("pagedllm::reshape_and_cache", "aten::index_copy", "aten::index",
                            "aten::repeat_interleave", "aten::masked_fill")),
    ("linear layers", ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul",
                       "mkldnn::_linear_pointwise", "pagedllm::w8a8_linear", "aten::_int_mm", "pagedllm::int8_linear",
                       "pagedllm::int4_linear")),
    ("sampling", ("aten::argmax", "aten::sort", "aten::topk", "aten::softmax", "aten::log_softmax",
                  "aten::exponential", "aten::gather")),
]


def categorize(name: str) -> str:
    for category, prefixes in CATEGORIES:
        if name.startswith(prefixes):
            return category
    return "elementwise (norm, rope, silu, residual, casts)"


def make_batch(llm: LLM, num_seqs: int, num_cached: int, num_new: int) -> ScheduledBatch:
    """One step of ``num_seqs`` sequences with ``num_cached`` tokens already cached, each
    computing ``num_new`` and sampling one."""
    engine = llm.llm_engine
    block_size = engine.args.block_size
    blocks_per_seq = -(-(num_cached + num_new) // block_size)
    if num_seqs * blocks_per_seq > engine.num_blocks:
        raise ValueError(f"the batch needs {num_seqs * blocks_per_seq} blocks, the cache has {engine.num_blocks}")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab_size = engine.model_config.vocab_size
    requests = []
    for i in range(num_seqs):
        token_ids = [(7 * i + j) % min(1000, vocab_size - 1) + 1 for j in range(num_cached + num_new)]
        requests.append(ScheduledRequest(f"p{i}", token_ids[num_cached:], num_cached,
                                         list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                                         (SamplingInput(f"p{i}", params),)))
    return ScheduledBatch(requests)


def time_step(runner, batch: ScheduledBatch, repeats: int) -> float:
    runner.execute_model(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute_model(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_step(runner, batch: ScheduledBatch, top: int = 0) -> tuple[float, dict[str, float]]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=top > 0) as prof:
        with record_function("step"):
            runner.execute_model(batch)
    if top:
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=top,
                                                                   max_name_column_width=40,
                                                                   max_shapes_column_width=60))
    wall = 0.0
    per_category: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key == "step":
            wall = event.cpu_time_total / 1e6
        elif event.key.startswith(("aten::", "pagedllm::", "mkldnn::")):
            per_category[categorize(event.key)] += event.self_cpu_time_total / 1e6
    per_category["python + other"] = wall - sum(per_category.values())
    return wall, per_category


def compare_python_layers(runner, batch: ScheduledBatch, fused_decode, rounds: int, repeats: int) -> None:
    """The decode step with the Python layers, then through ``decode_layers``, ``rounds`` times;
    prints each round's medians and the ratio of the medians of all rounds."""
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(rounds):
            for enabled in (False, True):
                fused_decode.enabled = enabled
                times[enabled].append(time_step(runner, batch, repeats))
    finally:
        fused_decode.enabled = True
    for enabled, label in ((False, "python layers"), (True, "decode_layers op")):
        print(f"  {label:17}: " + " ".join(f"{t * 1000:.1f}" for t in times[enabled])
              + f" ms/step, median {statistics.median(times[enabled]) * 1000:.1f}")
    print(f"  decode_layers op / python layers: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")


def paired_decode(llm: LLM, batch: ScheduledBatch, rounds: int) -> None:
    """Prints ``roofline.paired_fractions`` of a batch-1 decode step: its weight storages and
    the KV blocks of its one sequence (blocks ``0 .. n - 1``, ``make_batch``) against the step."""
    engine = llm.llm_engine
    (request,) = batch.requests
    num_blocks = len(request.block_table)
    kv_blocks = [cache[:num_blocks] for layer in engine.model_runner.kv_caches for cache in layer]
    views = roofline.storage_views(roofline.step_weight_tensors(engine.model))
    views += [blocks.reshape(-1).view(torch.uint8)[: blocks.nbytes // 4 * 4].view(torch.float32) for blocks in kv_blocks]
    step_bytes = (roofline.decode_weight_bytes(engine.model)
                  + request.num_computed_tokens * engine.bytes_per_block // engine.args.block_size)
    paired = roofline.paired_fractions(lambda: engine.model_runner.execute_model(batch), views, step_bytes, rounds)
    print(f"  paired: {rounds} steps ({step_bytes / 2**20:.0f} MiB each), each beside a read of the same bytes: "
          f"median {paired['median']:.0%} of the read's rate (range {min(paired['fractions']):.0%}-"
          f"{max(paired['fractions']):.0%}; medians: steps {paired['step_rate'] / 1e9:.1f} GB/s, "
          f"reads {paired['read_rate'] / 1e9:.1f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="as LLM(quantization=...)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as LLM(kv_cache_dtype=...)")
    parser.add_argument("--context", type=int, default=300, help="cached tokens per decode sequence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--config", default=None,
                        help="a config.json: its shape with random weights (load_format dummy); default SmolLM2-135M")
    parser.add_argument("--prefill-context", type=int, default=0, help="cached tokens before each prefill chunk")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="tokens per prefill chunk (default min(512, 2048 // batch))")
    parser.add_argument("--top", type=int, default=0, help="also print the N ops (by shape) of most self time")
    parser.add_argument("--compare-python-layers", type=int, default=0, metavar="ROUNDS",
                        help="also time each decode step with the Python layers against the fused C++ decode op, "
                             "alternated ROUNDS times (--repeats steps each)")
    parser.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                        help="also time ROUNDS batch-1 decode steps, each beside a read of the bytes it reads")
    parser.add_argument("--kinds", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def prefill_tokens(num_seqs: int) -> int:
        return args.prefill_tokens or min(512, 2048 // num_seqs)

    max_model_len = max(2048, args.context + 1, args.prefill_context + prefill_tokens(1))
    # The pool holds the largest step's blocks (16 tokens each).
    num_blocks = max([b * -(-max(args.context + 1, args.prefill_context + prefill_tokens(b)) // 16)
                      for b in args.batches] + [-(-max_model_len // 16)])
    model = {"model": args.config, "load_format": "dummy"} if args.config else {}
    llm = LLM(dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              max_model_len=max_model_len, max_num_seqs=max(64, *args.batches), block_size=16,
              max_num_batched_tokens=max(2048, *(b * prefill_tokens(b) for b in args.batches)),
              enable_prefix_caching=False, num_gpu_blocks_override=num_blocks, warm_kv_cache=True, **model)
    runner = llm.llm_engine.model_runner
    print(f"dtype {llm.llm_engine.model.dtype}, KV cache {llm.llm_engine.kv_cache_dtype}, "
          f"{torch.get_num_threads()} threads")
    for kind in args.kinds:
        for num_seqs in args.batches:
            if kind == "decode":
                batch = make_batch(llm, num_seqs, args.context, 1)
            else:
                batch = make_batch(llm, num_seqs, args.prefill_context, prefill_tokens(num_seqs))
            tokens = batch.total_num_scheduled_tokens
            median = time_step(runner, batch, args.repeats)
            wall, parts = profile_step(runner, batch, args.top)
            shares = ", ".join(f"{name} {100 * t / wall:.0f}%" for name, t in
                               sorted(parts.items(), key=lambda kv: -kv[1]))
            print(f"{kind:7} batch {num_seqs:3} ({tokens:4} tokens): {median * 1000:8.1f} ms/step, "
                  f"{tokens / median:7.1f} tokens/s | {shares}")
            if kind == "decode" and num_seqs == 1 and args.paired:
                paired_decode(llm, batch, args.paired)
            fused_decode = llm.llm_engine.model.fused_decode
            if kind == "decode" and args.compare_python_layers and fused_decode is not None:
                compare_python_layers(runner, batch, fused_decode, args.compare_python_layers, args.repeats)


if __name__ == "__main__":
    main()
