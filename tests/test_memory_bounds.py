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
