"""The C++ ops as built at install time: one library per instruction-set variant
(``pagedllm/cpu_isa.py``), the choice among them at run time, the check that a library matches
the sources beside it, the op tests under every variant this CPU executes, and a wheel that
runs where no compiler is."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm import cpu_isa
from pagedllm.layers import custom_op as ops_module
from pagedllm.layers.custom_op import NativeOpsUnavailable, native_ops

ROOT = Path(__file__).resolve().parent.parent
ZEN3 = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe".split())
ICE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
needs_x86 = pytest.mark.skipif(not cpu_isa.built_variants(), reason="the ISA variants are x86-64 builds")


@needs_x86
@pytest.mark.parametrize("flags,expected", [(ZEN3, "avx2"), (ZEN3 | {"avx512f"}, "avx2"),
                                            (ICE_LAKE - {"avx512_vnni"}, "avx512"), (ICE_LAKE, "avx512_vnni"),
                                            (ZEN4, "avx512_bf16")])
def test_the_highest_variant_the_cpu_executes_is_chosen(flags, expected, monkeypatch):
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    assert cpu_isa.select_variant(flags).name == expected


@needs_x86
def test_pagedllm_isa_forces_a_lower_variant_and_refuses_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert cpu_isa.select_variant(ZEN4).name == "avx2"
    with pytest.raises(ValueError, match=r"PAGEDLLM_ISA='avx512_bf16' needs CPU flags \['avx512_bf16'\]"):
        cpu_isa.select_variant(ICE_LAKE, "avx512_bf16")
    with pytest.raises(ValueError, match=r"'sse9' names no variant .* choose one of \['avx2', 'avx512'"):
        cpu_isa.select_variant(ZEN4, "sse9")
    with pytest.raises(ValueError, match="AVX2 and FMA is the lowest target"):
        cpu_isa.select_variant(frozenset({"sse2", "avx"}), "")


def test_cpu_flags_drop_what_cpuid_denies(monkeypatch):
    """Under an emulator (qemu-user with an AVX2-only CPU model) /proc/cpuinfo shows the host's
    flags; torch's CPUID checks decide which flag families this process may use."""
    import torch

    from pagedllm import platform

    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    host = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}
    monkeypatch.setattr(platform, "_cpuinfo_line", lambda *keys: " ".join(sorted(host)))
    for check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                  "_is_amx_tile_supported", "_is_avx2_supported"):
        monkeypatch.setattr(torch.cpu, check, lambda: True, raising=False)
    platform.cpu_flags.cache_clear()
    try:
        assert platform.cpu_flags() == host
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
        platform.cpu_flags.cache_clear()
        assert platform.cpu_flags() == ZEN3
        assert cpu_isa.select_variant(platform.cpu_flags()).name == "avx2"
    finally:
        platform.cpu_flags.cache_clear()


def test_a_pagedllm_isa_the_cpu_cannot_run_is_an_error_not_the_torch_path(monkeypatch):
    """A variant asked for by name (a typo, or one this CPU lacks) never turns into the many
    times slower torch references with only a log line."""
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512_bf17")
    native_ops.cache_clear()
    try:
        with pytest.raises(ValueError, match="'avx512_bf17' names no variant"):
            native_ops()
    finally:
        monkeypatch.delenv(cpu_isa.ISA_ENV)
        native_ops.cache_clear()


def test_the_loaded_library_is_the_chosen_variant_built_from_these_sources():
    ops = native_ops()
    if ops is None:
        pytest.skip(f"the C++ ops are not loaded: {ops_module.native_ops_error()}")
    assert ops.build_info() == f"{cpu_isa.select_variant().name} {cpu_isa.sources_digest(str(ops_module.CSRC))}"


def test_a_library_built_from_other_sources_is_refused(tmp_path, monkeypatch):
    """A checkout whose C++ was edited after its build: loading says to rebuild, never runs
    stale kernels."""
    if native_ops() is None:
        pytest.skip(f"the C++ ops are not loaded: {ops_module.native_ops_error()}")
    shutil.copytree(ops_module.CSRC, tmp_path / "csrc")
    with open(tmp_path / "csrc" / "ops.h", "a") as f:
        f.write("// edited\n")
    monkeypatch.setattr(ops_module, "CSRC", tmp_path / "csrc")
    ops_module.load_native_ops.cache_clear()
    try:
        with pytest.raises(NativeOpsUnavailable, match="built from other sources .* `pip install --no-build-isolation -e .`"):
            ops_module.load_native_ops()
        assert "other sources" in ops_module.native_ops_error()
    finally:
        ops_module.load_native_ops.cache_clear()


def test_a_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(ops_module, "PACKAGE_DIR", tmp_path)
    with pytest.raises(NativeOpsUnavailable, match=r"_C_avx2\.\*\.so is not built; .* PAGEDLLM_NATIVE_OPS=0"):
        ops_module.library_path(cpu_isa.VARIANTS[0])


# The op and parity tests against the torch references, as the other variants run them.
OP_TESTS = ["tests/test_fused_ops.py", "tests/test_attention.py", "tests/test_quantization.py",
            "tests/test_kv_cache_dtype.py", "tests/test_config_matrix.py", "tests/test_linear.py",
            "tests/test_gemma3.py", "tests/test_preemption_invariance.py"]
AVX512_TESTS = ["tests/test_attention.py", "tests/test_kv_cache_dtype.py", "tests/test_quantization.py"]


# The AVX2 build's run sees an AVX2-only CPU in torch too (an AMD Zen 3's view):
# tests/avx2_cpu/sitecustomize.py makes torch's CPUID checks deny AVX-512, AVX512_BF16, VNNI and
# AMX (so pagedllm's flags, its bf16 and AMX choices and the variants it reports are Zen 3's),
# and torch's, oneDNN's and MKL's own kernels stop at AVX2 (oneDNN then refuses bf16, and its int8
# product saturates: both red on a Zen 3 once, neither seen by PAGEDLLM_ISA=avx2 alone).
AVX2_CPU_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@needs_x86
@pytest.mark.parametrize("variant", [v.name for v in cpu_isa.VARIANTS[:-1]])
def test_lower_variant_passes_the_op_tests(variant):
    """Each variant below the one this process loaded, run in a subprocess (one variant per
    process): the AVX2 build runs every op test as on an AVX2-only CPU (``AVX2_CPU_ENV``), so
    the portable code under each ``#if defined(__AVX512F__)`` is tested on every CPU, and
    torch's AVX2 paths under the references; the AVX-512 builds without
    AVX512_BF16 / VNNI run the attention and quantized kernels whose paths those flags
    change at compile time. The highest variant is the one the rest of the suite runs."""
    runnable = [v.name for v in cpu_isa.executable_variants()]
    if variant not in runnable:
        pytest.skip(f"this CPU cannot execute the {variant} build (it runs {runnable})")
    if variant == runnable[-1]:
        pytest.skip(f"{variant} is this CPU's own build, which the whole suite runs")
    tests = OP_TESTS if variant == "avx2" else AVX512_TESTS
    env = dict(os.environ, PAGEDLLM_ISA=variant)
    if variant == "avx2":
        env.update(AVX2_CPU_ENV, PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT / "tests" / "avx2_cpu"), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                             "-k", "not smollm2 and not real_q4 and not answers_paris and not 270m"],
                            capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert f"pagedllm C++ ops: the {variant} build" in result.stdout
    assert " passed" in result.stdout and "failed" not in result.stdout


@needs_x86
@pytest.mark.skipif(not shutil.which("g++"), reason="building the wheel needs a C++ compiler")
def test_the_wheel_runs_without_a_compiler(tmp_path):
    """``pip wheel .`` carries every variant prebuilt: installed into a new venv, it loads its
    ops with no compiler on PATH. (The build reuses the editable install's objects in
    ``build/temp``, so it only links; the venv borrows the test venv's dependencies through a
    ``.pth`` rather than installing torch again.)"""
    wheel_dir = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                    "-w", str(wheel_dir), str(ROOT)], check=True, timeout=900, capture_output=True)
    (wheel,) = wheel_dir.glob("pagedllm-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=300, capture_output=True)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    check = textwrap.dedent(f"""
        import shutil, torch, pagedllm
        from pagedllm.layers import ops
        assert pagedllm.__file__.startswith({str(site)!r}), pagedllm.__file__
        assert not any(shutil.which(cc) for cc in ("g++", "c++", "gcc", "cc", "clang")), "a compiler is on PATH"
        x, w = torch.randn(3, 64), torch.randn(64)
        torch.testing.assert_close(ops.native_ops().rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6))
        print(ops.native_ops().build_info())
    """)
    env = {"PATH": str(venv / "bin"), "HOME": os.environ.get("HOME", "/root")}
    if cpu_isa.ISA_ENV in os.environ:  # the suite run with a forced variant (PAGEDLLM_ISA=avx2)
        env[cpu_isa.ISA_ENV] = os.environ[cpu_isa.ISA_ENV]
    avx2_cpu = ROOT / "tests" / "avx2_cpu"  # or as an AVX2-only CPU (bench/peers/avx2_env.sh)
    if any(Path(p).resolve() == avx2_cpu for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
        env.update({key: os.environ[key] for key in AVX2_CPU_ENV if key in os.environ}, PYTHONPATH=str(avx2_cpu))
    result = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == cpu_isa.select_variant().name
