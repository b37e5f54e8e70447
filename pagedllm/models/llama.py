"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over the paged KV cache.

Computes what Hugging Face ``transformers`` ``modeling_llama.py`` computes, in the same fp32
arithmetic, so that greedy output is token-for-token equal; the layout is vLLM's: Q/K/V and
gate/up projections are one matmul each, RoPE is applied in place to the QKV rows, the residual
add is fused into the next RMSNorm, and SiLU x up is one op (``layers/ops.py``).

The same layers run the families that differ from Llama only by a switch in ``LlamaConfig``:
Qwen2 (Q/K/V biases), Qwen3 (per-head q/k RMSNorm, ``qk_norm``) and Mistral (a
``sliding_window`` over every layer); ``models/hf_config.py`` reads those switches from a
``config.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, paged_attention
from pagedllm.layers.fused_decode import FusedDecode
from pagedllm.layers.linear import Linear, packing_available
from pagedllm.layers.ops import add_rms_norm_, native_ops, rms_norm, rotary_embedding_, silu_and_mul
from pagedllm.layers.quantization import QuantizableLinear
from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.models.sharding import TensorParallelShard


@dataclass
class LlamaConfig:
    """Architecture hyper-parameters (Hugging Face ``LlamaConfig`` names).

    ``attention_bias`` adds biases to the Q/K/V projections (Qwen2), ``o_proj_bias`` to the
    output projection (HF Llama's and Qwen3's ``attention_bias`` sets both), ``mlp_bias`` to
    gate, up and down (HF ``mlp_bias``). ``rope_scaling``: the scaled RoPE's HF parameters
    (``rope_type`` ``"linear"`` or ``"llama3"`` and theirs, see ``rope_inverse_frequencies``),
    None for plain RoPE; ``rope_freq_factors``: llama.cpp's per-frequency divisors (a GGUF's
    ``rope_freqs.weight``), None for none. ``qk_norm``: q and k are RMS-normed per head before
    RoPE (Qwen3). ``sliding_window``: every layer attends to the last ``sliding_window``
    positions, the current one included (Mistral; None: all of them). ``rotary_dim``: RoPE
    rotates the first ``rotary_dim`` features of each head only (HF ``partial_rotary_factor``,
    Phi-4-mini; None: all ``head_dim``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    architecture: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Optional[dict] = None
    rope_freq_factors: Optional[tuple[float, ...]] = None
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    rotary_dim: Optional[int] = None


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 (Zhang & Sennrich 2019).

    ``forward(x)`` normalizes ``[tokens, hidden]``; ``forward(x, residual)`` first adds ``x``
    into ``residual`` in place and normalizes the sum (one pass, ``layers/ops.py``).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm_(x, residual, self.weight, self.eps)


SCALED_ROPE_TYPES = ("linear", "llama3", "longrope")


def rope_inverse_frequencies(head_dim: int, theta: float, rope_scaling: Optional[dict] = None,
                             freq_factors: Optional[tuple[float, ...]] = None,
                             long_factors: bool = False) -> torch.Tensor:
    """RoPE's ``head_dim / 2`` inverse frequencies ``theta ** (-2i / head_dim)``, fp32 on the CPU,
    scaled as ``rope_scaling`` says, with the same fp32 operations as HF
    ``modeling_rope_utils.py`` (so the tables are bitwise transformers'):

    - ``{"rope_type": "linear", "factor": f}`` divides each by ``f`` (``_compute_linear_scaling_rope_parameters``);
    - ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}`` (Llama 3.1/3.2; ``_compute_llama3_parameters``):
      wavelengths ``2 pi / f`` longer than ``original / low_freq_factor`` are divided by
      ``factor``, those shorter than ``original / high_freq_factor`` kept, and the ones between
      interpolated linearly in ``original / wavelength``;
    - ``{"rope_type": "longrope", "short_factor", "long_factor", ...}`` (Phi-3.5/Phi-4-mini,
      LongRoPE, Ding et al. 2024; ``_compute_longrope_parameters``): frequency ``i`` divided by
      ``long_factor[i]`` when ``long_factors`` else by ``short_factor[i]`` (which of the two a
      model uses is ``RotaryEmbedding.use_long_factors``'s choice).

    ``head_dim`` is the rotated width (``rotary_dim`` under partial rotary).
    ``freq_factors`` (llama.cpp's ``rope_freqs.weight``, which its converter computes from the
    llama3 parameters) divides frequency ``i`` by ``freq_factors[i]``, as ``ggml_rope_ext`` does.

    Raises:
        ValueError: a ``rope_type`` other than those, or factors of the wrong length.
    """
    arange = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
        factors = rope_scaling["long_factor" if long_factors else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope has {len(factors)} factors, a rotary dimension of {head_dim} needs "
                             f"{head_dim // 2}")
        ext_factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
        return 1.0 / (ext_factors * theta ** (arange.float() / head_dim))
    inv_freq = 1.0 / (theta ** (arange.float() / head_dim))
    if freq_factors is not None:
        if len(freq_factors) != head_dim // 2:
            raise ValueError(f"rope_freqs has {len(freq_factors)} factors, head_dim {head_dim} needs {head_dim // 2}")
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, {', '.join(SCALED_ROPE_TYPES)})")
    factor = rope_scaling["factor"]
    low_freq_factor, high_freq_factor = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    original = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables, "rotate half" layout (Su et al. 2021; HF ``apply_rotary_pos_emb``).

    ``cos``/``sin``: ``[max_positions, rotary_dim]`` fp32, times the scaling's
    ``attention_factor`` (longrope; HF multiplies its cos/sin by it); the rotation itself is
    ``layers.ops.rotary_embedding_``, applied in place to the fused QKV rows, to the first
    ``rotary_dim`` features of each head. ``rope_scaling``/``freq_factors``: see
    ``rope_inverse_frequencies``.

    A longrope table starts with the short factors; ``use_long_factors`` switches.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: Optional[dict] = None,
                 freq_factors: Optional[tuple[float, ...]] = None) -> None:
        super().__init__()
        # Plain attributes on the CPU, not buffers: the model may be built on the meta device
        # and cast to bf16, and these must stay exact fp32 tables.
        self._args = (head_dim, max_positions, theta, rope_scaling, freq_factors)
        self.long_factors = False
        self.cos, self.sin = self._tables(False)

    def _tables(self, long_factors: bool) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_positions, theta, rope_scaling, freq_factors = self._args
        inv_freq = rope_inverse_frequencies(head_dim, theta, rope_scaling, freq_factors, long_factors)
        freqs = torch.arange(max_positions, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = (rope_scaling or {}).get("attention_factor", 1.0)
        return (emb.cos() * scale, emb.sin() * scale) if scale != 1.0 else (emb.cos(), emb.sin())

    def use_long_factors(self, long_factors: bool) -> None:
        """Rebuild the tables with longrope's long (or short) factors, in place of the others.

        Raises:
            ValueError: ``long_factors`` without longrope scaling.
        """
        rope_scaling = self._args[3]
        if long_factors and (rope_scaling or {}).get("rope_type") != "longrope":
            raise ValueError("long RoPE factors need rope_type 'longrope'")
        if long_factors != self.long_factors:
            self.long_factors = long_factors
            self.cos, self.sin = self._tables(long_factors)


class LlamaAttention(nn.Module):
    """Grouped-query attention over this rank's heads (``tp``): Q/K/V column-parallel, o_proj
    row-parallel, its partial sums added over the ranks by one all-reduce.

    With ``config.qk_norm`` each head of q and k is RMS-normed (``q_norm``/``k_norm``,
    ``[head_dim]`` weights) before RoPE (HF ``modeling_qwen3.py``: ``Qwen3Attention``).
    """

    def __init__(self, config: LlamaConfig, tp: TensorParallelShard = TensorParallelShard()) -> None:
        super().__init__()
        self.tp_size = tp.size
        self.num_heads = tp.num_heads(config)
        self.num_kv_heads = tp.num_kv_heads(config)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def norm_qk_(self, qkv: torch.Tensor) -> None:
        """Norm q and k inside the fused ``[num_tokens, q + 2 kv]`` rows in place, before RoPE:
        per head with ``qk_norm`` (Qwen3), else nothing (a subclass may norm otherwise)."""
        if self.q_norm is not None:
            num_tokens = qkv.shape[0]
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.q_size))
            k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.kv_size))

    def forward(self, positions, hidden, kv_cache, metadata, rotary):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        self.norm_qk_(qkv)
        rotary_embedding_(qkv, positions, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads,
                          self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.o_proj(paged_attention(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale,
                                          self.sliding_window).reshape(num_tokens, self.q_size))
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class LlamaMLP(nn.Module):
    """SwiGLU over this rank's intermediate rows: gate/up column-parallel, down row-parallel
    (one all-reduce)."""

    def __init__(self, config: LlamaConfig, tp: TensorParallelShard = TensorParallelShard()) -> None:
        super().__init__()
        self.tp_size = tp.size
        intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TensorParallelShard = TensorParallelShard()) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, positions, hidden, residual, kv_cache, metadata, rotary):
        """``residual`` (the stream HF adds every sub-layer's output to) is None for the first
        layer; it is updated in place, and ``hidden`` is the sub-layer output not yet added."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rotary)
        hidden = self.mlp(self.post_attention_layernorm(hidden, residual))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder. Weights are loaded with ``load_hf_state_dict``.

    ``forward`` takes the flat batch of this step and returns hidden states; ``compute_logits``
    runs the LM head only on the rows that sample.

    Args:
        config: the architecture.
        dtype: the compute (and default KV cache) dtype, kept once the weights are quantized.
        quantization: ``"int8"``, ``"int4"`` or None: the method ``quantize_model`` applies
            to the loaded weights (vLLM's ``quant_config``; ``models/loader.py: build_model``).
        tp: the tensor-parallel rank this model is the shard of (``models/sharding.py``); its
            decoder layers hold that rank's heads and rows and all-reduce, and
            ``load_hf_state_dict`` takes that rank's slice of each weight
            (``TensorParallelShard.shard_state_dict``).

    Attributes:
        fused_decode: runs the decoder layers of a decode-only step as one C++ call
            (``layers/fused_decode.py``); ``fused_decode.enabled = False`` forces the Python layers.
            None where the layers have another shape: a sliding window (Mistral), partial
            rotary (Phi-4-mini), or a subclass's own layers (``models/gemma3.py``,
            ``models/olmoe.py``); the op implements the Llama layer, with Qwen3's per-head q/k
            norms and with a MoE block (``models/moe.py``). Off under tensor parallelism: the
            op runs every layer in one call, and the all-reduces must run between its
            attention and MLP halves.
        unquantized_weight_bytes: the weights' bytes before ``quantize_model`` (None: not quantized).
        lora_context: the ``LoRAContext`` of LoRA serving (``pagedllm/lora/layers.py: wrap_model``
            wraps the projections), None without. A step with adapter rows runs the Python
            layers: the fused decode op has no LoRA.

    Raises:
        ValueError: biases on o_proj or the MLP with ``tp.size > 1`` (a row-parallel layer's
            bias would be added once per rank by the all-reduce), or a ``rope_type`` that
            ``rope_inverse_frequencies`` does not implement.
    """

    def __init__(self, config: LlamaConfig, dtype: torch.dtype = torch.float32,
                 quantization: Optional[str] = None, tp: TensorParallelShard = TensorParallelShard()) -> None:
        super().__init__()
        tp.check(config, quantization)
        if tp.size > 1 and (config.o_proj_bias or config.mlp_bias):
            raise ValueError(f"tensor_parallel_size={tp.size} with biases on o_proj or the MLP (attention_bias / "
                             "mlp_bias) is not supported: use tensor_parallel_size=1")
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.quantization = quantization
        self.unquantized_weight_bytes: Optional[int] = None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, config.rope_freq_factors)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.requires_grad_(False)
        self.fused_decode: Optional[FusedDecode] = None
        self.lora_context = None
        if config.sliding_window is None and config.rotary_dim in (None, config.head_dim):
            self.fused_decode = FusedDecode(self.layers, self.rotary, config.rms_norm_eps, quantization)
            self.fused_decode.enabled = tp.size == 1

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads this model's KV cache holds (all of them unless it is a tensor-parallel shard)."""
        return self.tp.num_kv_heads(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                metadata: AttentionMetadata) -> torch.Tensor:
        """Args: ``input_ids``/``positions`` ``[num_tokens]`` int64; one (K, V) cache pair per layer.

        Returns: ``[num_tokens, hidden_size]`` final-normed hidden states.
        """
        hidden, residual = self.embed(input_ids)
        lora_rows = self.lora_context is not None and self.lora_context.groups
        if self.fused_decode is not None and not lora_rows and self.fused_decode.applies(metadata, hidden.shape[0]):
            hidden, residual = self.fused_decode(hidden, positions, kv_caches, metadata)
        else:
            for index, kv_cache in enumerate(kv_caches):
                hidden, residual = self.run_layer(index, positions, hidden, residual, kv_cache, metadata)
        return self.norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The first decoder layer's input for ``[num_tokens]`` int64 ids: ``(hidden, residual)``,
        hidden ``[num_tokens, hidden_size]`` in the compute dtype, residual None."""
        return self.embed_tokens(input_ids), None

    def run_layer(self, index: int, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                  kv_cache: tuple[torch.Tensor, torch.Tensor],
                  metadata: AttentionMetadata) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Decoder layer ``index`` on the state ``embed`` or the layer before returned: the
        next ``(hidden, residual)``. ``forward`` is ``embed``, this for every layer, the final
        norm; the w8a8 calibration (``models/quantize.py: LayerCalibration``) runs it on each
        layer as soon as that layer is loaded."""
        return self.layers[index](positions, hidden, residual, kv_cache, metadata, self.rotary)

    def quantizable_linears(self) -> list[QuantizableLinear]:
        """The projections a quantization method replaces (``models/quantize.py``): per decoder
        layer the fused Q/K/V, o, fused gate/up and down projections, each with the Hugging
        Face weights fused into it (the keys of its pre-quantized parts)."""
        linears = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            linears += [QuantizableLinear(attn, "qkv_proj", [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                        QuantizableLinear(attn, "o_proj", [p + "self_attn.o_proj.weight"])]
            linears += self._mlp_linears(layer.mlp, p)
        return linears

    def _mlp_linears(self, mlp: nn.Module, prefix: str) -> list[QuantizableLinear]:
        return [QuantizableLinear(mlp, "gate_up_proj", [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]),
                QuantizableLinear(mlp, "down_proj", [prefix + "mlp.down_proj.weight"])]

    def pack_linear_weights(self) -> int:
        """Pre-pack every unquantized ``Linear`` (``Linear.pack``: bf16 into ``bf16_linear``'s
        tiles, fp32 into ``fp32_linear``'s, else for oneDNN), the LM head included. Returns how many layers were packed.

        A head tied to the embedding is untied first: the embedding keeps a plain copy of the
        table to look rows up in (SmolLM2: 28M more parameters, 57 MiB in bf16), because an
        unpacked head costs more than it saves: ``torch.mm`` reorders its 57 MiB for every
        decode step (1 thread, AMD EPYC family 26, bf16, 1 row: 8.3 ms vs 1.5 ms packed;
        ``bench/linear_layout.py``).
        """
        if not packing_available(self.dtype) and native_ops() is None:
            return 0
        head = self.lm_head
        linears = [m for layer in self.layers for m in layer.modules() if isinstance(m, Linear)]
        num_packed = 0
        if isinstance(head, Linear) and head.packed is None and head.blocked is None:
            if self.embed_tokens.weight.untyped_storage().data_ptr() == head.weight_t.untyped_storage().data_ptr():
                self.embed_tokens.weight = nn.Parameter(head.weight_t.t().contiguous(), requires_grad=False)
            num_packed += head.pack(fp32_out=True)
        if self.fused_decode is not None:
            self.fused_decode.invalidate()
        return num_packed + sum(linear.pack() for linear in linears)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` -> ``[num_rows, vocab_size]`` fp32 logits.

        Every head hands its fp32 products over unrounded, a bf16 one included: rounded to bf16
        (steps of 0.125 at SmolLM2's logit sizes), near-equal logits became exact ties that
        greedy decoding broke by token id (issue 19.1: int4 + bf16 answered "L'Étoile..." to
        "What is the capital of France?" where the logits of "L" and "The" were 0.1 apart; the
        unquantized bf16 model did the same until its head kept fp32 too).
        """
        return self.lm_head(hidden, out_dtype=torch.float32)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor],
                           on_layer_loaded: Optional[Callable[[int], None]] = None) -> None:
        """Install weights named as in Hugging Face ``LlamaForCausalLM``, cast to ``self.dtype``.

        Q/K/V and gate/up (weights and biases) are concatenated into the fused projections. A
        missing ``lm_head.weight`` (or ``tie_word_embeddings``) ties the head to the embedding.
        Works on a model built on the meta device: every parameter is replaced.
        ``on_layer_loaded(i)`` runs as soon as decoder layer ``i`` holds its weights
        (``build_model`` quantizes the layer there, so that no more than one layer is ever
        held in float).

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        def take(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            return self.tp.shard_weight(name, state_dict[name], self.config)

        def put(module: nn.Module, attr: str, value: torch.Tensor, name: str) -> None:
            if isinstance(module, Linear) and attr == "weight":
                try:
                    module.set_weight(value, dtype)
                except ValueError as exc:
                    raise ValueError(f"weight {name!r}: {exc}") from None
                return
            expected = tuple(getattr(module, attr).shape)
            if expected != tuple(value.shape):
                raise ValueError(f"weight {name!r}: expected shape {expected}, got {tuple(value.shape)}")
            setattr(module, attr, nn.Parameter(value.to(dtype).contiguous(), requires_grad=False))

        dtype = self.dtype
        if self.fused_decode is not None:
            self.fused_decode.invalidate()
        put(self.embed_tokens, "weight", take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, "weight", take("model.norm.weight"), "model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            put(attn.qkv_proj, "weight", qkv, p + "self_attn.qkv_proj.weight")
            if attn.qkv_proj.bias is not None:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                put(attn.qkv_proj, "bias", bias, p + "self_attn.qkv_proj.bias")
            put(attn.o_proj, "weight", take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if attn.o_proj.bias is not None:
                put(attn.o_proj, "bias", take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            self._load_mlp(layer.mlp, p, take, put)
            norms = ["input_layernorm", "post_attention_layernorm"]
            if attn.q_norm is not None:
                norms += ["self_attn.q_norm", "self_attn.k_norm"]
            for norm in norms:
                module = layer.get_submodule(norm)
                put(module, "weight", take(p + norm + ".weight"), p + norm + ".weight")
            if on_layer_loaded is not None:
                on_layer_loaded(i)
        if "lm_head.weight" in state_dict and not self.config.tie_word_embeddings:
            put(self.lm_head, "weight", state_dict["lm_head.weight"], "lm_head.weight")
        else:
            # Tied: one copy, stored transposed for the head; the embedding looks rows up
            # through a view of it (a strided gather, ~10 ms for 2048 tokens).
            self.lm_head.set_weight(self.embed_tokens.weight, dtype)
            self.embed_tokens.weight = nn.Parameter(self.lm_head.weight_t.t(), requires_grad=False)

    def _load_mlp(self, mlp: nn.Module, prefix: str, take: Callable, put: Callable) -> None:
        """Install a decoder layer's MLP: gate and up fused (``prefix``: ``model.layers.N.``;
        ``take(name)`` reads this rank's slice of a checkpoint tensor, ``put(module, attribute,
        tensor, name)`` installs it)."""
        gate_up = torch.cat([take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")])
        put(mlp.gate_up_proj, "weight", gate_up, prefix + "mlp.gate_up_proj.weight")
        put(mlp.down_proj, "weight", take(prefix + "mlp.down_proj.weight"), prefix + "mlp.down_proj.weight")
        if mlp.gate_up_proj.bias is not None:
            gate_up_bias = torch.cat([take(prefix + "mlp.gate_proj.bias"), take(prefix + "mlp.up_proj.bias")])
            put(mlp.gate_up_proj, "bias", gate_up_bias, prefix + "mlp.gate_up_proj.bias")
            put(mlp.down_proj, "bias", take(prefix + "mlp.down_proj.bias"), prefix + "mlp.down_proj.bias")
