"""Building and loading the C++ ops: an interrupted build never blocks a later start, and the
portable (non-AVX-512) build passes the same op tests as the native one."""

import os
import platform
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
    monkeypatch.setenv("PAGEDLLM_MARCH", "x86-64-v3")
    assert build_directory() not in (first, other_cpu)


def test_two_checkouts_of_the_same_sources_build_in_two_folders(tmp_path, monkeypatch):
    """ninja's build file holds the sources' absolute paths: a shared folder would rebuild
    whenever the other checkout loads."""
    first = build_directory()
    copies = []
    for source in ops_module.SOURCES:
        copy = tmp_path / "csrc" / source.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(ops_module, "SOURCES", copies)
    assert build_directory() != first


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86 target")
def test_portable_build_passes_the_op_tests():
    """The C++ ops built for AVX2 without AVX-512 (``PAGEDLLM_MARCH=x86-64-v3``), so that the
    portable code under every ``#if defined(__AVX512F__)`` runs here too, pass the same tests
    against the torch references as the native build: every op, every dtype, quantization and
    KV cache dtype on the tiny model."""
    tests = ["tests/test_fused_ops.py", "tests/test_attention.py", "tests/test_quantization.py",
             "tests/test_kv_cache_dtype.py", "tests/test_config_matrix.py", "tests/test_linear.py",
             "tests/test_gemma3.py"]
    env = dict(os.environ, PAGEDLLM_MARCH="x86-64-v3")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                             "-k", "not smollm2 and not real_q4 and not answers_paris and not 270m"],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="skylake-avx512 is an x86 target")
def test_avx512_build_without_vnni_passes_the_attention_tests():
    """The C++ ops built for AVX-512 without AVX512_VNNI (``PAGEDLLM_MARCH=skylake-avx512``):
    decode attention over an int8 cache then scores by VPMADDWD instead of VPDPBUSD, a path
    chosen at compile time, so it runs here only in such a build. The quantized GEMMs choose
    theirs at run time and test both in the native build (``portable``)."""
    if "avx512bw" not in ops_module._cpu_flags():
        pytest.skip("this CPU cannot run an AVX-512 build")
    env = dict(os.environ, PAGEDLLM_MARCH="skylake-avx512")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_attention.py",
                             "tests/test_kv_cache_dtype.py"], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
