"""What keeps a long-running engine's memory flat (issue 19.5)."""

from __future__ import annotations

import os

from pagedllm.worker import model_runner
from tests.conftest import make_tiny_engine

_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def test_engine_bounds_onednn_primitive_caches(monkeypatch):
    """bf16 matmuls at ever new row counts fill oneDNN's caches (1,024 primitives each by
    default, ~0.3 MB apiece): the engine caps them before its first matmul."""
    for name in _CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    make_tiny_engine()
    for name in _CACHE_VARIABLES:
        assert os.environ[name] == str(model_runner.ONEDNN_CACHE_CAPACITY)


def test_engine_keeps_a_user_set_onednn_cache_capacity(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    make_tiny_engine()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(model_runner.ONEDNN_CACHE_CAPACITY)


def _resident_kib(tensor) -> int:
    """KiB of ``tensor``'s memory mapped into this process (/proc/self/smaps, its mapping)."""
    address = tensor.data_ptr()
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields[0].split("-")) == 2 and not fields[0].endswith(":"):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError("the tensor's mapping is not in /proc/self/smaps")


def test_kv_pool_is_zeros_mapped_on_first_touch():
    """The KV pool reads as zeros, takes writes, and is not resident until touched: a 64 MiB
    pool holds (almost) nothing in RAM after allocation and its first block after one write."""
    import torch

    pool = model_runner._lazy_zeros((1024, 16, 8, 128), torch.bfloat16)  # 64 MiB
    assert pool.shape == (1024, 16, 8, 128) and pool.dtype == torch.bfloat16
    assert _resident_kib(pool) < 4096
    pool[3].fill_(1.5)
    assert float(pool[3].sum()) == 1.5 * pool[3].numel() and int(torch.count_nonzero(pool)) == pool[3].numel()
    assert _resident_kib(pool) < 8192
    assert model_runner._lazy_zeros((0, 16), torch.float32).numel() == 0
