"""The physical limits of this CPU and how close pagedllm comes to them.

    python bench/roofline.py --config bench/configs/Llama-3.1-8B-Instruct.json [--quantization int4]
    python bench/roofline.py --config bench/configs/tiny-llama.json --context 512 --buffer-mib 128 \\
        --gemm 512 1024 1024 --repeats 3   # the smoke run

1. Memory bandwidth: ``dst.copy_(src)`` of two ``--buffer-mib`` buffers (bytes read + written)
   and ``src.sum()`` (bytes read), best of ``--repeats``, torch's threads. The buffers are in
   transparent huge pages, as the engine's weights and KV pool are: on 4 KiB pages the same
   sum read 27 GB/s where it read 33-35 on huge pages (Zen 4, 2026-12-06), and a decode step
   then appeared to run above its bound.
2. Peak GEMM rate: ``torch.mm`` of ``[m, k] x [k, n]`` (default 2048 x 4096 x 4096) in fp32 and
   bf16 (oneDNN), and int8 x int8 -> int32 (``torch._int_mm``), best of ``--repeats``.
3. The model of ``--config`` (``load_format="dummy"``, see bench/scale.py), one request alone:
   - decode at ``--context`` tokens: the bound is the bytes one step reads (the decoder
     layers' and LM head's weights, as built: quantized ones at their size; plus the KV of the
     context) over the read bandwidth; reported as measured rate / bound rate, against the
     fresh buffers' best read and against a read of the step's own weight storages where they
     lie (``weights_read_bandwidth``);
     and, in pairs, each decode step timed beside a read of the bytes it read
     (``paired_decode``);
   - prefill of ``--context`` tokens: its FLOPs (2 per weight of the decoder projections per
     token, attention's ``4 * heads * head_dim`` per token pair of the causal half, the LM head
     once) over the time to first token, as a fraction of the GEMM peak of the compute dtype
     (int8 for w8a8/w4a8, whose products are int8).

Figures are for the machine as it is while the script runs: on a shared machine they are
lower bounds of what it can do.
"""

from __future__ import annotations

import argparse
import statistics
import time
import torch

from pagedllm.huge_pages import huge_page_zeros
from pagedllm.layers.quantization import weight_bytes
from pagedllm.models.dummy import hf_weight_shapes
from pagedllm.sampling_params import SamplingParams

import scale  # bench/scale.py, beside this file


def _best_time(run, repeats: int) -> float:
    run()  # warm-up (page faults, oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(buffer_mib: int, repeats: int) -> dict:
    """``{"copy": bytes/s (read + written), "read": bytes/s}``."""
    elements = buffer_mib * 2**20 // 4
    src, dst = (huge_page_zeros(elements * 4).view(torch.float32) for _ in range(2))
    src.uniform_()
    copy = _best_time(lambda: dst.copy_(src), repeats)
    read = _best_time(lambda: src.sum(), repeats)
    return {"copy": 2 * src.nbytes / copy, "read": src.nbytes / read}


def gemm_peaks(m: int, n: int, k: int, repeats: int) -> dict:
    """FLOP/s (2 per multiply-add) of ``torch.mm`` by dtype: float32, bfloat16, int8."""
    flops = 2 * m * n * k
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.rand(m, k).to(dtype), torch.rand(k, n).to(dtype)
        peaks[str(dtype).replace("torch.", "")] = flops / _best_time(lambda: torch.mm(a, b), repeats)
    a8 = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    b8 = torch.randint(-128, 128, (k, n), dtype=torch.int8)
    peaks["int8"] = flops / _best_time(lambda: torch._int_mm(a8, b8), repeats)
    return peaks


def weights_read_bandwidth(module: torch.nn.Module, repeats: int) -> float:
    """Bytes/s of ``sum`` over the very storages ``module``'s parameters and buffers lie in (each
    once, read as float32 with denormals flushed), best of ``repeats``: the read rate of the
    bytes a decode step reads, where they lie. A fresh buffer can land on faster memory than
    weights allocated minutes earlier (Zen 4 VM, 2026-12-07: a 1 GiB buffer read 33-38 GB/s
    while buffers allocated after it read 48-55 in the same seconds)."""
    views = storage_views(list(module.parameters()) + list(module.buffers()))
    torch.set_flush_denormal(True)  # random bits read as float32: no slow denormal adds
    try:
        seconds = _best_time(lambda: [view.sum() for view in views], repeats)
    finally:
        torch.set_flush_denormal(False)  # torch's default; the engine never sets it
    return sum(view.nbytes for view in views) / seconds


def storage_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 views of the storages ``tensors`` lie in, each storage once (its whole bytes)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(storage)
    return [raw[: raw.numel() // 4 * 4].view(torch.float32) for raw in storages.values()]


def paired_fractions(step, views: list[torch.Tensor], step_bytes: int, rounds: int) -> dict:
    """``rounds`` pairs of one call of ``step`` (which reads ``step_bytes``) and a ``sum`` over
    ``views`` (the same bytes where they lie), best of 3. Each pair's fraction is the step's
    rate over the read's a moment later, so a VM whose bandwidth moves 2x within a minute moves
    both sides of a pair alike. Returns the fractions, their median and the median rates (B/s)."""
    read_bytes = sum(view.nbytes for view in views)
    fractions, step_rates, read_rates = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        step_rates.append(step_bytes / (time.perf_counter() - start))
        read = float("inf")
        torch.set_flush_denormal(True)  # random bits read as float32: no slow denormal adds
        try:
            for _ in range(3):
                start = time.perf_counter()
                for view in views:
                    view.sum()
                read = min(read, time.perf_counter() - start)
        finally:
            torch.set_flush_denormal(False)  # torch's default; the engine never sets it
        read_rates.append(read_bytes / read)
        fractions.append(step_rates[-1] / read_rates[-1])
    return {"fractions": fractions, "median": statistics.median(fractions),
            "step_rate": statistics.median(step_rates), "read_rate": statistics.median(read_rates)}


def step_weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of what a decode step multiplies by: the decoder layers, the
    final norm and the LM head."""
    step_weights = torch.nn.ModuleList([model.layers, model.norm, model.lm_head])
    return list(step_weights.parameters()) + list(step_weights.buffers())


def paired_decode(llm, prompt: list[int], steps: int, step_bytes: int) -> dict:
    """``paired_fractions`` of one request's ``steps`` decode steps (``engine.step``: scheduling
    and sampling included), each against a read of the step's weight storages and the whole KV
    pool, which ``scale.build_llm`` sizes to the request.

    Raises:
        RuntimeError: if the request ends before its prefill gives a token.
    """
    engine = llm.llm_engine
    views = storage_views(step_weight_tensors(engine.model)
                          + [cache for layer in engine.model_runner.kv_caches for cache in layer])
    engine.add_request("paired-decode", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    while not any(o.outputs and o.outputs[0].token_ids for o in engine.step()):
        if not engine.has_unfinished_requests():
            raise RuntimeError("the request ended before its first token")
    return paired_fractions(engine.step, views, step_bytes, steps)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: the decoder layers', final norm's and LM
    head's as built (the token embedding is a row lookup). One ``weight_bytes`` over the three,
    since the layers' weights may share one storage with the others (each counted once)."""
    return weight_bytes(torch.nn.ModuleList([model.layers, model.norm, model.lm_head]))


def model_fractions(args: argparse.Namespace, bandwidth: float, peaks: dict) -> dict:
    """Decode and prefill of one ``--context``-token request against the bounds. The read
    bandwidth is measured again just before and just after the request, and the bound takes the
    highest of the three rates (``bandwidth`` is the first): a cloud VM's rate moves by 2x
    within minutes (Zen 4, 2026-12-06: 35 and 63 GB/s a minute apart), and a bound from a slow
    minute put a decode at 124 % of it."""
    llm = scale.build_llm(args, args.context + args.decode_tokens,
                          -(-(args.context + args.decode_tokens) // scale.BLOCK_SIZE) + 1)
    engine = llm.llm_engine
    model, config = engine.model, engine.model_config
    scale.single_stream(llm, [1] * 64, 4)  # warm-up
    step_weights = torch.nn.ModuleList([model.layers, model.norm, model.lm_head])
    reads = [bandwidth, memory_bandwidth(args.buffer_mib, args.repeats)["read"]]
    own_reads = [weights_read_bandwidth(step_weights, args.repeats)]
    measured = scale.single_stream(llm, scale._prompt(args.context, config.vocab_size, 0), args.decode_tokens)
    own_reads.append(weights_read_bandwidth(step_weights, args.repeats))
    reads.append(memory_bandwidth(args.buffer_mib, args.repeats)["read"])
    bandwidth = max(reads)
    step_bytes = decode_weight_bytes(model) + args.context * engine.bytes_per_block // scale.BLOCK_SIZE
    bound_rate = bandwidth / step_bytes
    projections = sum(shape[0] * shape[1] for name, shape in hf_weight_shapes(config).items()
                      if ".layers." in name and name.endswith("proj.weight"))
    attention = 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    prefill_flops = (2 * projections * args.context + attention * args.context * (args.context + 1) / 2
                     + 2 * config.vocab_size * config.hidden_size)
    compute = "int8" if args.quantization in ("w8a8", "w4a8") else str(model.dtype).replace("torch.", "")
    prefill_rate = prefill_flops / measured["ttft_s"]
    own_bound_rate = max(own_reads) / step_bytes
    paired = paired_decode(llm, scale._prompt(args.context, config.vocab_size, 1), args.decode_tokens - 1, step_bytes)
    return {"paired": paired, "reads": reads, "own_reads": own_reads, "step_bytes": step_bytes,
            "decode_own_fraction": measured["decode_tokens_per_s"] / own_bound_rate, "decode_tokens_per_s": measured["decode_tokens_per_s"],
            "decode_bound_tokens_per_s": bound_rate,
            "decode_fraction": measured["decode_tokens_per_s"] / bound_rate,
            "prefill_flops": prefill_flops, "prefill_flops_per_s": prefill_rate, "prefill_peak": compute,
            "prefill_fraction": prefill_rate / peaks[compute]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    scale.add_model_arguments(parser)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--buffer-mib", type=int, default=512)
    parser.add_argument("--gemm", type=int, nargs=3, default=[2048, 4096, 4096], metavar=("M", "N", "K"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    bandwidth = memory_bandwidth(args.buffer_mib, args.repeats)
    print(f"memory: copy {bandwidth['copy'] / 1e9:.1f} GB/s (read + written), read {bandwidth['read'] / 1e9:.1f} GB/s "
          f"({args.buffer_mib} MiB buffers)")
    peaks = gemm_peaks(*args.gemm, args.repeats)
    print("GEMM peak " + ", ".join(f"{name} {rate / 1e9:.0f} GFLOP/s" for name, rate in peaks.items())
          + " (m, n, k = {}, {}, {})".format(*args.gemm))
    result = model_fractions(args, bandwidth["read"], peaks)
    print(f"decode at {args.context} tokens: {result['decode_tokens_per_s']:.2f} tok/s of a bound "
          f"{result['decode_bound_tokens_per_s']:.2f} ({result['step_bytes'] / 2**20:.0f} MiB read per token): "
          f"{result['decode_fraction']:.0%} (read bandwidth before, just before and just after the request: "
          + ", ".join(f"{read / 1e9:.1f}" for read in result["reads"]) + " GB/s; the bound takes the highest)")
    print(f"  the step's own weights, summed where they lie, read {result['own_reads'][0] / 1e9:.1f} GB/s before "
          f"and {result['own_reads'][1] / 1e9:.1f} after: decode at {result['decode_own_fraction']:.0%} of that bound")
    fractions = result["paired"]["fractions"]
    print(f"  {len(fractions)} decode steps, each beside a read of the step's weights and KV pool: median "
          f"{result['paired']['median']:.0%} of that read's rate (range {min(fractions):.0%}-{max(fractions):.0%}; medians: steps "
          f"{result['paired']['step_rate'] / 1e9:.1f} GB/s, reads {result['paired']['read_rate'] / 1e9:.1f} GB/s)")
    print(f"prefill of {args.context} tokens: {result['prefill_flops_per_s'] / 1e9:.0f} GFLOP/s, "
          f"{result['prefill_fraction']:.0%} of the {result['prefill_peak']} GEMM peak")


if __name__ == "__main__":
    main()
