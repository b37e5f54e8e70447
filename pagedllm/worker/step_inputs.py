"""A step's model inputs sent from rank 0 to the other tensor-parallel ranks as two broadcasts:
a fixed int64 header, then one flat int64 tensor (no pickling per step; vLLM's CPU worker
broadcasts its ``ModelInputForCPU`` tensors the same way).

Header (``HEADER_LEN`` int64, on the control group, which idle workers wait on without a
timeout): ``command`` (``STEP`` or ``SHUTDOWN``), ``num_tokens``, ``num_decode_tokens``,
``decode_max_blocks``, ``num_prefills``, ``prefill_table_len`` (sum of their block tables'
lengths), ``num_copies``, ``flat_len``.
Flat tensor (on the data group): ``input_ids``, ``positions``, ``slot_mapping`` (each
``num_tokens``), the decode block tables (``num_decode_tokens x decode_max_blocks``) and context
lengths, per prefill ``(start, end, context_len, table_len)``, the prefills' block tables one
after another, the copy-on-write sources, then destinations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import TensorParallelError
from pagedllm.layers.attention import AttentionMetadata, PrefillSequence
from pagedllm.lora.manager import LoRAMapping

STEP, SHUTDOWN = 1, 0
HEADER_LEN = 8


@dataclass
class StepInputs:
    """What every rank needs to compute a step.

    Attributes:
        input_ids, positions: ``[num_tokens]`` int64.
        metadata: slot mapping, decode block tables / context lengths, prefill chunks.
        blocks_to_copy: copy-on-write ``(src, dst)`` block ids, applied before the forward.
        lora_mapping: the rows of each LoRA adapter, None when no row has one. Never
            broadcast: LoRA runs with one rank only (``EngineArgs.verify``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    blocks_to_copy: Sequence[tuple[int, int]] = ()
    lora_mapping: Optional[LoRAMapping] = None


def _broadcast(tensor: torch.Tensor, group) -> None:
    try:
        dist.broadcast(tensor, 0, group=group)
    except RuntimeError as exc:
        raise TensorParallelError(f"broadcast of the step inputs failed, a tensor-parallel rank is gone: "
                                  f"{exc}") from exc


def broadcast_step(step: StepInputs) -> None:
    """Rank 0: send ``step`` to the other ranks.

    Raises:
        TensorParallelError: a rank is gone.
    """
    assert step.lora_mapping is None, "LoRA runs without tensor parallelism"
    m = step.metadata
    num_decode = m.num_decode_tokens
    decode_tables = m.decode_block_tables if num_decode else torch.empty(0, 0, dtype=torch.int64)
    parts = [step.input_ids, step.positions, m.slot_mapping, decode_tables.reshape(-1),
             m.decode_context_lens if num_decode else torch.empty(0, dtype=torch.int64),
             torch.tensor([[p.start, p.end, p.context_len, len(p.block_table),
                           -1 if p.num_prompt_tokens is None else p.num_prompt_tokens] for p in m.prefills],
                          dtype=torch.int64).reshape(-1)]
    parts += [p.block_table for p in m.prefills]
    parts += [torch.tensor([s for s, _ in step.blocks_to_copy], dtype=torch.int64),
              torch.tensor([d for _, d in step.blocks_to_copy], dtype=torch.int64)]
    flat = torch.cat([part.to(torch.int64).reshape(-1) for part in parts])
    header = torch.tensor([STEP, len(step.input_ids), num_decode, decode_tables.shape[1], len(m.prefills),
                           sum(len(p.block_table) for p in m.prefills), len(step.blocks_to_copy),
                           flat.numel()], dtype=torch.int64)
    _broadcast(header, parallel_state.control_group())
    _broadcast(flat, parallel_state.data_group())


def broadcast_shutdown() -> None:
    """Rank 0: tell the other ranks to leave their loop."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = SHUTDOWN
    _broadcast(header, parallel_state.control_group())


def receive_step() -> Optional[StepInputs]:
    """Ranks 1..: wait for rank 0's next step; None when it says shut down.

    Raises:
        TensorParallelError: rank 0 is gone.
    """
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    _broadcast(header, parallel_state.control_group())
    (command, num_tokens, num_decode, max_blocks, num_prefills, prefill_table_len, num_copies,
     flat_len) = header.tolist()
    if command == SHUTDOWN:
        return None
    flat = torch.empty(flat_len, dtype=torch.int64)
    _broadcast(flat, parallel_state.data_group())
    sizes = [num_tokens, num_tokens, num_tokens, num_decode * max_blocks, num_decode, 5 * num_prefills,
             prefill_table_len, num_copies, num_copies]
    (input_ids, positions, slot_mapping, decode_tables, context_lens, prefill_meta, prefill_tables,
     copy_src, copy_dst) = flat.split(sizes)
    prefills, offset = [], 0
    for start, end, context_len, table_len, num_prompt in prefill_meta.view(num_prefills, 5).tolist():
        prefills.append(PrefillSequence(start, end, context_len, prefill_tables[offset:offset + table_len],
                                        None if num_prompt < 0 else num_prompt))
        offset += table_len
    metadata = AttentionMetadata(slot_mapping=slot_mapping, prefills=prefills, num_decode_tokens=num_decode)
    if num_decode:
        metadata.decode_block_tables = decode_tables.view(num_decode, max_blocks)
        metadata.decode_context_lens = context_lens
    return StepInputs(input_ids, positions, metadata, list(zip(copy_src.tolist(), copy_dst.tolist())))
