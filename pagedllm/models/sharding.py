"""Which slice of each weight a tensor-parallel rank holds (Megatron-LM's split, Shoeybi et
al. 2019, section 3; vLLM ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``QKVParallelLinear``).

Column-parallel (output features split): Q/K/V by heads and gate/up by intermediate rows, so
attention and SiLU x up run on local heads / rows with no communication. Row-parallel (input
features split): o_proj and down_proj, each rank producing a partial sum of the full hidden
state that one all-reduce adds up (after attention and after the MLP). Norms, the embedding and
the LM head are replicated. KV heads are split like Q heads; when there are fewer KV heads than
ranks each one is replicated on ``size / num_kv_heads`` ranks (vLLM's rule), so a rank always
holds the KV head its Q heads read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from pagedllm.layers.quantization import INT4_GROUP_SIZE, get_quant_method

if TYPE_CHECKING:
    from pagedllm.layers.quantization import Int4Weight
    from pagedllm.models.llama import LlamaConfig

_COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


# Families whose layers this module splits (Llama-shaped decoder layers).
SHARDED_ARCHITECTURES = ("llama", "qwen2")

@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks (``size == 1``: the whole model)."""

    rank: int = 0
    size: int = 1

    def check(self, config: "LlamaConfig", quantization: Union[str, None] = None) -> None:
        """Whether ``config`` splits over ``size`` ranks.

        Raises:
            ValueError: a family whose layers are not sharded (Gemma 3), or naming the dimension
                that does not divide: Q heads, KV heads (when
                ``num_kv_heads >= size`` they must divide by it, else ``size`` by them), the
                intermediate size; or what ``quantization``'s method refuses
                (``QuantMethod.check_tensor_parallel``: for ``int4`` a row-parallel input slice
                that is not a whole number of 32-weight groups).
        """
        size = self.size
        if size == 1:
            return
        if config.architecture not in SHARDED_ARCHITECTURES:
            raise ValueError(f"tensor_parallel_size={size}: the {config.architecture!r} family runs with "
                             f"tensor_parallel_size=1 only (sharded: {', '.join(SHARDED_ARCHITECTURES)})")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {heads} attention "
                             f"heads ({kv_heads} KV heads): use a size that divides both")
        if kv_heads >= size and kv_heads % size or kv_heads < size and size % kv_heads:
            raise ValueError(f"tensor_parallel_size={size} and the model's {kv_heads} KV heads: one must "
                             "divide the other (KV heads are split, or replicated when fewer than ranks)")
        if config.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size="
                             f"{config.intermediate_size}")
        if quantization is not None:
            column_rows = {"q_proj": self.num_heads(config) * config.head_dim,
                           "k_proj": self.num_kv_heads(config) * config.head_dim,
                           "gate_proj": config.intermediate_size // size}
            row_inputs = {"o_proj": heads * config.head_dim, "down_proj": config.intermediate_size}
            get_quant_method(quantization).check_tensor_parallel(size, column_rows, row_inputs)

    def num_heads(self, config: "LlamaConfig") -> int:
        """Q heads on this rank."""
        return config.num_attention_heads // self.size

    def num_kv_heads(self, config: "LlamaConfig") -> int:
        """KV heads on this rank (1 when they are replicated)."""
        return max(1, config.num_key_value_heads // self.size)

    def _rows(self, name: str, config: "LlamaConfig") -> slice:
        """The output features of column-parallel weight ``name`` on this rank."""
        d = config.head_dim
        if name.endswith("q_proj"):
            n = self.num_heads(config) * d
            return slice(self.rank * n, (self.rank + 1) * n)
        if name.endswith(("k_proj", "v_proj")):
            n = self.num_kv_heads(config) * d
            first_head = self.rank * config.num_key_value_heads // self.size
            return slice(first_head * d, first_head * d + n)
        n = config.intermediate_size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def shard_weight(self, name: str, weight: Union[torch.Tensor, "Int4Weight"],
                     config: "LlamaConfig") -> Union[torch.Tensor, "Int4Weight"]:
        """This rank's part of the Hugging Face weight or bias ``name``
        (``model.layers.N.self_attn.q_proj.weight``): rows of a column-parallel one, input
        columns of a row-parallel one (for an ``Int4Weight`` whole groups), else all of it."""
        if self.size == 1 or ".layers." not in name:
            return weight
        module = name.split(".layers.", 1)[1].split(".", 1)[1].rsplit(".", 1)[0]
        if module in _COLUMN_PARALLEL:
            rows = self._rows(module, config)
            if isinstance(weight, torch.Tensor):
                return weight[rows].contiguous()
            return type(weight)(weight.codes[rows], weight.scales[rows], weight.mins[rows])
        if module in _ROW_PARALLEL:
            width = weight.shape[1] if isinstance(weight, torch.Tensor) else weight.codes.shape[1]
            n = width // self.size
            cols = slice(self.rank * n, (self.rank + 1) * n)
            if isinstance(weight, torch.Tensor):
                return weight[:, cols].contiguous()
            groups = slice(cols.start // INT4_GROUP_SIZE, cols.stop // INT4_GROUP_SIZE)
            return type(weight)(weight.codes[:, cols].contiguous(), weight.scales[:, groups].contiguous(),
                                weight.mins[:, groups].contiguous())
        return weight

    def shard_state_dict(self, state_dict: dict, config: "LlamaConfig") -> dict:
        """``shard_weight`` of every entry (a new dict; the input is not changed)."""
        if self.size == 1:
            return state_dict
        return {name: self.shard_weight(name, weight, config) for name, weight in state_dict.items()}
