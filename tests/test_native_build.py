"""Building and loading the C++ ops: an interrupted build never blocks a later start."""

import subprocess
import sys

import pytest

from pagedllm.layers import ops as ops_module
from pagedllm.layers.ops import build_directory, native_ops


def test_interrupted_build_lock_does_not_hang_the_next_start():
    """A process killed while compiling leaves torch's ``lock`` file behind (issue 19.2);
    the next start removes it and loads the ops instead of waiting forever."""
    if native_ops() is None:
        pytest.skip("the C++ ops cannot be built here")
    lock = build_directory() / "lock"
    lock.touch()
    code = "from pagedllm.layers.ops import native_ops; assert native_ops() is not None"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "left by a build that was interrupted" in result.stderr
    assert not lock.exists()


def test_build_directory_depends_on_cpu_flags_and_sources(monkeypatch):
    """A build for one CPU's instruction set is never loaded on another CPU."""
    first = build_directory()
    monkeypatch.setattr(ops_module, "_cpu_flags", lambda: "flags : fpu sse2")
    other_cpu = build_directory()
    assert other_cpu != first and other_cpu.parent == first.parent
    monkeypatch.setattr(ops_module, "CFLAGS", ops_module.CFLAGS + ["-DX"])
    assert build_directory() not in (first, other_cpu)
