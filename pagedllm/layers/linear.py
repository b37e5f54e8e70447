"""Dense linear layer with its weight stored transposed, ``[in_features, out_features]``.

``torch.nn.functional.linear`` multiplies by a ``[out, in]`` weight through a transposed view,
and on this CPU (torch 2.13, MKL) that path is 3-4x slower than a plain ``torch.mm`` by a
``[in, out]`` contiguous weight at 8-32 rows, the batch sizes most decode steps run at
(measured: ``bench/linear_layout.py``); at one row and at prefill sizes the two are equal. The
layer therefore keeps only the transposed copy. The results are the same matmul in another
blocking order: equal to ``F.linear`` up to fp32 rounding (the HF parity tests pin greedy
output).
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` for ``x`` ``[num_tokens, in_features]``.

    Attributes:
        weight_t: ``[in_features, out_features]`` contiguous, the compute dtype.
        bias: ``[out_features]`` or None.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @property
    def weight(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight as a view (no copy)."""
        return self.weight_t.t()

    def set_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        """Install a ``[out_features, in_features]`` weight (any dtype), stored transposed.

        Raises:
            ValueError: the shape is not ``[out_features, in_features]``.
        """
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"expected a weight of shape {(self.out_features, self.in_features)}, "
                             f"got {tuple(weight.shape)}")
        self.weight_t = nn.Parameter(weight.to(dtype).t().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def kernel_args(self) -> list[torch.Tensor]:
        """The tensors the C++ ``decode_layers`` op multiplies by: ``[weight_t]`` (+ ``bias``)."""
        return [self.weight_t] + ([] if self.bias is None else [self.bias])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

