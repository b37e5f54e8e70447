"""Mistral decoder (Mistral 7B v0.1-v0.3, Ministral, Mistral Small/NeMo text): the Llama
architecture with, where the config sets one, a sliding window over every layer.

Hugging Face ``modeling_mistral.py`` is ``modeling_llama.py`` without biases and with
``sliding_window`` passed to every layer's attention (a token at position ``p`` sees ``p - W + 1
.. p``; ``masking_utils.sliding_window_overlay``). Mistral 7B v0.1 sets 4096; v0.2 and later set
null (full attention). The window runs in ``layers/attention.py``, which Gemma 3's local layers
use too; a windowed model decodes through the Python layers (the fused C++ decode op has no
window). llama.cpp writes Mistral GGUFs under the ``llama`` architecture, without the window, so
those load as Llama, with full attention, as llama.cpp runs them.
"""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` for Mistral checkpoints (same weight names); ``config.sliding_window``
    (``models/hf_config.py`` reads it) windows every layer."""
