"""Tensors in anonymous memory advised into 2 MiB pages (transparent huge pages).

Two users: the KV pool (``worker/model_runner.py``), and the model's weights, which a decode
step streams through once per token. On 4 KiB pages a matmul's read of its weight crosses a
page every 4 KiB; the hardware prefetchers stop at page boundaries and every new page is a TLB
miss. Measured on an AMD EPYC (Zen 4), 2 threads, the 120 matmuls of a SmolLM2-135M decode
step at one row (``bf16_linear``, 212 MB of bf16 weights): 9.4 ms on 4 KiB pages, 6.6 ms on
2 MiB pages (bench/README.md, "Zen 4 profile, small batches").
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch
from torch import nn

ALIGNMENT = 64  # bytes: every tensor placed in an arena starts on a cache line
PAGE = 4096  # bytes: madvise ranges start on a page
MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (include/uapi/asm-generic/mman-common.h)
TRIM_BYTES = 64 << 20  # move_weights_to_huge_pages returns freed pages to the OS this often


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (a ``uint8`` tensor) in anonymous memory that the OS maps on first
    touch, advised ``MADV_HUGEPAGE`` where the kernel has it (transparent huge pages are often
    in "madvise" mode); elsewhere the same zeros in 4 KiB pages. ``nbytes`` must be positive."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    return torch.frombuffer(memory, dtype=torch.uint8)


def move_weights_to_huge_pages(module: nn.Module) -> int:
    """Copy every parameter and buffer of ``module`` into one huge-page arena, in module order
    (the order a forward pass reads them), and point the tensors at their copies. Values are
    unchanged, bitwise. Skipped: oneDNN-packed tensors (no storage), tensors on the meta device,
    and any storage that more than one distinct view shares (moving those would untie them).
    Returns the bytes moved. Each old tensor is freed once its copy replaces it (unless
    something else holds it) and the freed pages go back to the OS every ``TRIM_BYTES``
    (``release_freed_memory``), so the process grows by about ``TRIM_BYTES``, not by the
    weights a second time. Callers holding references to the old tensors must drop them
    (``FusedDecode.invalidate``).
    """
    tensors: list[torch.Tensor] = []
    views: dict[int, set] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_mkldnn or tensor.is_meta or tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        key = tensor.untyped_storage().data_ptr()
        views.setdefault(key, set()).add((tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
                                          tensor.dtype))
        tensors.append(tensor)
    movable, seen = [], set()
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        if len(views[key]) == 1 and key not in seen and tensor.is_contiguous():
            seen.add(key)
            movable.append(tensor)
    offsets, total = [], 0
    for tensor in movable:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    if total == 0:
        return 0
    arena = huge_page_zeros(total)
    untrimmed = 0
    for tensor, offset in zip(movable, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        copy = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        tensor.data = copy
        untrimmed += nbytes
        if untrimmed >= TRIM_BYTES:
            release_freed_memory()
            untrimmed = 0
    release_freed_memory()
    return total


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def release_freed_memory() -> bool:
    """Give the pages of freed heap memory back to the OS (glibc ``malloc_trim(0)``).

    Why it is needed: after the first free of a large block glibc raises its mmap threshold
    (up to 32 MiB), so tensors of a few MiB then come from the heap, and freeing them keeps
    their pages in the process. Building a model layer by layer (a float layer drawn or read,
    quantized, dropped) or copying the weights into one arena would otherwise keep every freed
    layer resident: Qwen3-30B-A3B in w4a8 grew past 24 GiB with 19 GB of weights. Returns False
    where the C library has no ``malloc_trim`` (nothing happened then)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):  # not Linux / no madvise
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def populate_for_write(tensor: torch.Tensor, start: int, end: int) -> bool:
    """Map bytes ``[start, end)`` of contiguous ``tensor``'s memory for writing now, contents
    unchanged (``MADV_POPULATE_WRITE``): the page faults a first write would take, taken ahead
    (for a huge-page region, the whole 2 MiB pages the range touches). Safe on memory in use.
    Returns False where the kernel (< 5.14) or the OS cannot; nothing happened then."""
    madvise = _madvise()
    if madvise is None or end <= start:
        return madvise is not None
    address = tensor.data_ptr() + start
    aligned = address - address % PAGE
    return madvise(aligned, end - start + (address - aligned), MADV_POPULATE_WRITE) == 0
