"""Which adapters are loaded, and the rows of a step that run through each (vLLM
``vllm/lora/worker_manager.py: LRUCacheWorkerLoRAManager`` and ``models.py: LoRAModelManager``).

Two LRUs, as vLLM's: up to ``max_cpu_loras`` adapters as read from disk (``LoRAModel``,
fp32), and up to ``max_loras`` *active* ones packed for the forward (``PackedLoRA``: ``A^T``
of a fused projection concatenated, in the compute dtype). A step's adapters are made active
first; an adapter is evicted from the active LRU only if neither the step nor a running
request uses it (``LoRAMapping.lora_ids_in_use``: the scheduler admits no more distinct
adapters into the running set than ``max_loras``, so there is always such a slot). An
evicted adapter is packed again from the CPU LRU when a request needs it, or read again
from its ``lora_path`` when that dropped it too.

Mechanism only: the scheduler decided which requests (and so which adapters) run.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from pagedllm.lora.layers import PackedLoRA, pack_adapter, wrap_model
from pagedllm.lora.models import LoRAModel
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class LoRAMapping:
    """Which rows of a step's flat batch run through which adapter (vLLM's ``LoRAMapping``, as
    row ranges instead of one id per token).

    Attributes:
        ranges: ``lora_int_id`` -> ``[start, end)`` row ranges, in row order; rows of no
            adapter are in none.
        lora_requests: ``lora_int_id`` -> its ``LoRARequest`` (where to read it from).
        lora_ids_in_use: adapters of every running request, scheduled this step or not: never
            evicted from the active LRU.
    """

    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    lora_requests: dict[int, LoRARequest] = field(default_factory=dict)
    lora_ids_in_use: frozenset[int] = frozenset()

    def add_rows(self, lora_request: LoRARequest, start: int, end: int) -> None:
        """Rows ``[start, end)`` run through ``lora_request``'s adapter (merged with the range
        before when they touch)."""
        lora_id = lora_request.lora_int_id
        self.lora_requests[lora_id] = lora_request
        ranges = self.ranges.setdefault(lora_id, [])
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))


class LoRAModelManager:
    """The adapters of one model.

    Args:
        model: a ``LlamaForCausalLM`` (or subclass with the same projection names); its
            projections are wrapped in ``LoRALinear``s (``wrap_model``).
        max_loras: most adapters active at once (and so in one step).
        max_lora_rank: highest rank an adapter may have.
        max_cpu_loras: most adapters kept as read from disk.

    Attributes:
        num_disk_loads: adapters read from disk since start (a reload counts again).
        num_activations: adapters packed into the active LRU since start.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model = model
        self.config = model.config
        self.dtype = model.dtype
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.context = wrap_model(model)
        self._cpu: OrderedDict[int, LoRAModel] = OrderedDict()
        self._active: OrderedDict[int, dict[tuple[int, str], PackedLoRA]] = OrderedDict()
        self.num_disk_loads = 0
        self.num_activations = 0

    # ----------------------------------------------------------------------------- loading
    def add_adapter(self, lora_request: LoRARequest) -> bool:
        """Read and check the adapter unless the CPU LRU holds it. Returns whether it was read.

        Raises:
            ValueError: what ``LoRAModel.from_local_checkpoint`` refuses.
        """
        if lora_request.lora_int_id in self._cpu:
            self._cpu.move_to_end(lora_request.lora_int_id)
            return False
        self._load(lora_request)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget the adapter (both LRUs). A running request that still uses it reads it again
        from its path. Returns whether it was loaded."""
        found = self._cpu.pop(lora_int_id, None) is not None
        return self._active.pop(lora_int_id, None) is not None or found

    def list_adapters(self) -> list[int]:
        """Ids of the adapters held (CPU or active), least recently used first."""
        return list(dict.fromkeys([*self._cpu, *self._active]))

    @property
    def active_adapters(self) -> list[int]:
        """Ids of the active (packed) adapters, least recently used first."""
        return list(self._active)

    def _load(self, lora_request: LoRARequest) -> LoRAModel:
        lora_model = LoRAModel.from_local_checkpoint(lora_request.lora_path, lora_request.lora_int_id,
                                                     self.config, self.max_lora_rank)
        self.num_disk_loads += 1
        self._cpu[lora_request.lora_int_id] = lora_model
        while len(self._cpu) > self.max_cpu_loras:
            evicted, _ = self._cpu.popitem(last=False)
            logger.debug("LoRA adapter %d dropped from the CPU cache (max_cpu_loras=%d)", evicted,
                         self.max_cpu_loras)
        return lora_model

    def _activate(self, lora_request: LoRARequest, keep: frozenset[int]) -> dict[tuple[int, str], PackedLoRA]:
        lora_id = lora_request.lora_int_id
        packed = self._active.get(lora_id)
        if packed is None:
            lora_model = self._cpu.get(lora_id) or self._load(lora_request)
            self._cpu.move_to_end(lora_id)
            packed = pack_adapter(lora_model, self.config, self.dtype)
            self.num_activations += 1
            while len(self._active) >= self.max_loras:
                victim = next((i for i in self._active if i not in keep), None)
                if victim is None:
                    raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters in use "
                                       f"({sorted(self._active)}): the scheduler admitted too many")
                del self._active[victim]
            self._active[lora_id] = packed
        self._active.move_to_end(lora_id)
        return packed

    # ----------------------------------------------------------------------------- steps
    @contextmanager
    def activate(self, mapping: LoRAMapping) -> Iterator[None]:
        """Within the block, the model's ``LoRALinear``s add each group's LoRA to its rows.

        Raises:
            ValueError: an adapter that must be read again fails to load.
            RuntimeError: more distinct adapters in use than ``max_loras``.
        """
        keep = mapping.lora_ids_in_use | set(mapping.ranges)
        groups = []
        for lora_id, ranges in mapping.ranges.items():
            packed = self._activate(mapping.lora_requests[lora_id], frozenset(keep))
            if len(ranges) == 1:
                rows = slice(*ranges[0])
            else:
                rows = torch.cat([torch.arange(start, end) for start, end in ranges])
            groups.append((packed, rows))
        for lora_id in mapping.lora_ids_in_use:
            if lora_id in self._active:
                self._active.move_to_end(lora_id)
        self.context.groups = groups
        try:
            yield
        finally:
            self.context.groups = []
