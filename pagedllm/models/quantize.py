"""Applying a quantization method to a built model (vLLM's loader step
``process_weights_after_loading``), and the calibration pass ``w8a8`` needs (SmoothQuant, Xiao
et al. 2023, section 4): the largest ``|x[:, k]|`` each projection sees on a calibration text,
from one forward pass of the float model.

The methods themselves (``layers/quantization/``) convert one layer at a time; the model says
which projections it has (``quantizable_linears()``), so neither side knows the other's names.

The calibration text is the part of the public-domain text shipped with pagedllm
(``pagedllm/data/public_domain.txt``) that ``pagedllm bench accuracy`` does not score: its
first ``ACCURACY_TOKENS`` tokens are the perplexity set, the calibration starts after them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from pagedllm.data import TEXT_PATH
from pagedllm.layers.attention import AttentionMetadata, PrefillSequence
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization import (Int4Weight, Int8Embedding, Int8Weight, QuantizableLinear, get_quant_method,
                                          weight_bytes)

# Tokens of the shipped text that ``pagedllm bench accuracy`` scores (its default --num-tokens).
ACCURACY_TOKENS = 2048
CALIBRATION_TOKENS = 1024
_BLOCK_SIZE = 16


def quantize_model(model: nn.Module, prequantized: Optional[dict[str, "Int4Weight | Int8Weight"]] = None,
                   calibration_token_ids: Optional[list[int]] = None, streamed_bytes_saved: int = 0) -> None:
    """Replace every projection of the decoder layers (``model.quantizable_linears()``) by its
    quantized form, in place, by the method the model was built with (``model.quantization``;
    ``QuantMethod.quantize_linear``), then the LM head and token embedding
    (``QuantMethod.quantize_vocab``), and record ``model.unquantized_weight_bytes``.

    Args:
        model: a ``LlamaForCausalLM`` (or subclass) with weights installed (for a checkpoint
            method, the quantized projections' float weights may be meta placeholders).
            Projections already quantized (``quantize_linears`` as each layer was loaded) are
            left as they are.
        prequantized: weights by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``):
            ``Int4Weight`` for ``int4`` / ``w4a8`` (GGUF 4-bit; a fused layer uses them when
            every part is there, else quantizes its float weight) and the checkpoint methods,
            ``Int8Weight`` for the 8-bit checkpoint methods.
        calibration_token_ids: for a method that ``needs_calibration`` (``w8a8``): the
            calibration text's token ids (none: no smoothing).
        streamed_bytes_saved: what ``quantize_linears`` returned for the projections quantized
            while loading (bytes), so that ``unquantized_weight_bytes`` counts them in float.

    Raises:
        ValueError: unknown method, a layer whose shape the method's layout cannot hold (for
            ``int4``, ``in_features`` not in groups of 32), or a fused projection that a
            checkpoint quantized only in part or with different input orders.
    """
    method = get_quant_method(model.quantization)
    prequantized = prequantized or {}
    linears = model.quantizable_linears()
    activation_absmax = {}
    if method.needs_calibration and calibration_token_ids:
        activation_absmax = collect_input_absmax(model, calibration_token_ids, linears)
    saved = quantize_linears(model, linears, prequantized, activation_absmax)
    if model.fused_decode is not None:  # None: a family the C++ decode op does not run (Gemma 3)
        model.fused_decode.invalidate()
    if method.from_checkpoint:
        quantized = [getattr(owner, attribute) for owner, attribute, _ in linears]
        quantized = [m for m in quantized if hasattr(m, "input_order")]
        # What the same layers would take as float weights in the compute dtype.
        model.unquantized_weight_bytes = weight_bytes(model) + sum(
            m.out_features * m.in_features * model.dtype.itemsize
            - sum(t.numel() * t.element_size() for t in m.buffers() if t is not None and t is not m.bias)
            for m in quantized)
        if model.fused_decode is not None and any(m.input_order is not None for m in quantized):
            model.fused_decode.enabled = False  # decode_layers has no input gather
        return
    model.unquantized_weight_bytes = weight_bytes(model) + saved + streamed_bytes_saved
    tied = model.embed_tokens.weight.untyped_storage().data_ptr() == model.lm_head.weight_t.untyped_storage().data_ptr()
    vocab = method.quantize_vocab(model.lm_head, model.embed_tokens.weight, tied)
    if vocab is not None:
        model.lm_head, table = vocab
        model.embed_tokens = Int8Embedding(table, model.dtype)


def quantize_linears(model: nn.Module, linears: list[QuantizableLinear],
                     prequantized: dict[str, "Int4Weight | Int8Weight"],
                     activation_absmax: Optional[dict[nn.Module, torch.Tensor]] = None) -> int:
    """Replace each of ``linears`` that is still a float ``Linear`` by ``model.quantization``'s
    quantized layer (``prequantized`` and ``activation_absmax`` as for ``quantize_model``).

    Returns:
        the bytes the replaced float weights held beyond their quantized form.
    """
    method = get_quant_method(model.quantization)
    activation_absmax = activation_absmax or {}
    saved = 0
    for owner, attribute, checkpoint_names in linears:
        linear = getattr(owner, attribute)
        if not isinstance(linear, Linear):
            continue
        parts = {name: prequantized.get(name) for name in checkpoint_names}
        quantized = method.quantize_linear(linear, parts, activation_absmax.get(linear))
        setattr(owner, attribute, quantized)
        if not method.from_checkpoint:
            saved += weight_bytes(linear) - weight_bytes(quantized)
    return saved


def calibration_token_ids(tokenizer, vocab_size: int, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """``num_tokens`` token ids to calibrate on: the shipped text after its first
    ``ACCURACY_TOKENS`` tokens, or, without a tokenizer (a model built from a checkpoint in
    memory), ids drawn from ``[0, vocab_size)`` with seed 0."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    ids = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    return ids[ACCURACY_TOKENS:ACCURACY_TOKENS + num_tokens] if len(ids) >= ACCURACY_TOKENS + num_tokens \
        else ids[-num_tokens:]


class LayerCalibration:
    """The calibration prefill of ``collect_input_absmax``, one decoder layer at a time: each
    layer runs on the float output of the one before as soon as it is loaded, and can then be
    quantized, so that the float model is never whole (Llama-3.1-8B in bf16 is 16 GB, in w8a8
    8 GB). The same calls on the same inputs as the whole model's forward: the same absmax,
    bitwise.

    Args:
        model: a ``LlamaForCausalLM`` (or subclass) whose embedding is loaded.
        token_ids: the calibration text (``calibration_token_ids``).

    Raises:
        ValueError: ``token_ids`` is empty or longer than the model's positions.
    """

    def __init__(self, model: nn.Module, token_ids: list[int]) -> None:
        _check_calibration_tokens(model, token_ids)
        self.model = model
        self.token_ids = torch.tensor(token_ids)
        num_tokens = len(token_ids)
        self.num_blocks = -(-num_tokens // _BLOCK_SIZE)
        self.positions = torch.arange(num_tokens)
        self.metadata = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens),
            prefills=[PrefillSequence(0, num_tokens, num_tokens, torch.arange(self.num_blocks))])
        self.state: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    @torch.no_grad()
    def run_layer(self, index: int, linears: list[QuantizableLinear]) -> dict[nn.Module, torch.Tensor]:
        """Run decoder layer ``index`` (layers go in order from 0) and return ``{layer:
        [in_features] fp32}``, the largest absolute input each of ``linears`` saw."""
        model = self.model
        if self.state is None:
            self.state = model.embed(self.token_ids)
        with _recording_absmax(linears) as absmax:
            self.state = model.run_layer(index, self.positions, *self.state, _kv_cache(model, self.num_blocks),
                                         self.metadata)
        return absmax


def _check_calibration_tokens(model: nn.Module, token_ids: list[int]) -> None:
    if not token_ids or len(token_ids) > model.rotary.cos.shape[0]:
        raise ValueError(f"calibration needs 1 to {model.rotary.cos.shape[0]} tokens, got {len(token_ids)}")


def _kv_cache(model: nn.Module, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed (K, V) cache pair of ``num_blocks`` blocks for one of the model's layers."""
    shape = (num_blocks, _BLOCK_SIZE, model.num_kv_heads_per_rank, model.config.head_dim)
    return torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)


@contextmanager
def _recording_absmax(linears: list[QuantizableLinear]) -> Iterator[dict[nn.Module, torch.Tensor]]:
    """Within the block, every forward of one of ``linears`` records into the yielded dict the
    largest ``|x[:, k]|`` of its inputs so far (``{layer: [in_features] fp32}``)."""
    absmax: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, inputs: tuple) -> None:
        seen = inputs[0].detach().float().abs().amax(dim=0)
        absmax[module] = seen if module not in absmax else torch.maximum(absmax[module], seen)

    hooks = [getattr(owner, attribute).register_forward_pre_hook(record) for owner, attribute, _ in linears]
    try:
        yield absmax
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def collect_input_absmax(model: nn.Module, token_ids: list[int],
                         linears: Optional[list[QuantizableLinear]] = None) -> dict[nn.Module, torch.Tensor]:
    """``{layer: [in_features] fp32}``: the largest absolute input of every projection of
    ``linears`` (default ``model.quantizable_linears()``) over one prefill of ``token_ids``
    (one sequence, a temporary KV cache).

    Raises:
        ValueError: ``token_ids`` is empty or longer than the model's positions.
    """
    _check_calibration_tokens(model, token_ids)
    linears = model.quantizable_linears() if linears is None else linears
    with _recording_absmax(linears) as absmax:
        num_tokens = len(token_ids)
        num_blocks = -(-num_tokens // _BLOCK_SIZE)
        metadata = AttentionMetadata(slot_mapping=torch.arange(num_tokens),
                                     prefills=[PrefillSequence(0, num_tokens, num_tokens, torch.arange(num_blocks))])
        model(torch.tensor(token_ids), torch.arange(num_tokens), [_kv_cache(model, num_blocks) for _ in model.layers],
              metadata)
    return absmax
