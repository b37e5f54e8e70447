"""What keeps a long-running engine's memory flat (issue 19.5), and what bounds a quantized build's peak."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import platform
from pagedllm.huge_pages import TRIM_BYTES
from pagedllm.models.dummy import hf_weight_shapes, load_dummy_checkpoint
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
        assert os.environ[name] == str(platform.ONEDNN_CACHE_CAPACITY)


def test_engine_keeps_a_user_set_onednn_cache_capacity(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    make_tiny_engine()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(platform.ONEDNN_CACHE_CAPACITY)


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


def _resident_bytes(tensor, start: int, end: int) -> int:
    """Bytes of ``[start, end)`` of ``tensor``'s memory in RAM, by ``mincore`` (whole pages)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = (tensor.data_ptr() + start) // page * page
    pages = -(-(tensor.data_ptr() + end - first) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) * page


def test_warm_kv_cache_faults_the_pool_in_block_order_and_keeps_its_contents(monkeypatch):
    """LLMEngine.warm_kv_cache (MADV_POPULATE_WRITE, slice by slice): every layer's K and V at
    the lowest blocks first, then the next blocks; what is written stays; the byte counts add
    up to the pool; where the OS cannot, it reports 0 and stops."""
    engine = make_tiny_engine(num_gpu_blocks_override=40_000)  # 19.5 MiB per K or V cache
    runner = engine.model_runner
    regions = [cache for layer in runner.kv_caches for cache in layer]
    size = regions[0].numel() * regions[0].element_size()
    slice_bytes = model_runner.KV_WARM_SLICE
    assert size > 8 * slice_bytes
    regions[0][7].fill_(2.5)  # a block in use
    regions[-1][-1].fill_(-1.0)  # the last block of the last region
    tail = (4 * slice_bytes, size - 4 * slice_bytes)  # far from both ends
    assert all(_resident_bytes(region, *tail) == 0 for region in regions)
    assert engine.warm_kv_cache(len(regions) * slice_bytes) == len(regions) * slice_bytes
    assert all(_resident_bytes(region, 0, slice_bytes) == slice_bytes for region in regions)
    assert all(_resident_bytes(region, *tail) == 0 for region in regions)
    total = len(regions) * slice_bytes
    while (warmed := engine.warm_kv_cache(3 * 2**20)) > 0:
        total += warmed
    assert total == len(regions) * size
    assert all(_resident_bytes(region, 0, size) == size for region in regions)
    assert engine.warm_kv_cache(2**20) == 0
    assert float(regions[0][7].sum()) == 2.5 * regions[0][7].numel()
    assert float(regions[-1][-1].sum()) == -regions[-1][-1].numel()
    assert sum(int(torch.count_nonzero(region)) for region in regions) == 2 * regions[0][7].numel()

    fresh = make_tiny_engine()
    monkeypatch.setattr(model_runner, "populate_for_write", lambda tensor, start, end: False)
    assert fresh.warm_kv_cache(2**20) == 0 and fresh.warm_kv_cache(2**20) == 0


def test_warm_kv_cache_option_faults_the_pool_in_at_start():
    from pagedllm.config import EngineArgs
    from pagedllm.sampling_params import SamplingParams
    from tests.conftest import run_to_completion

    engines = [make_tiny_engine(num_gpu_blocks_override=40_000, warm_kv_cache=warm) for warm in (False, True)]
    cold, warm = ([cache for layer in engine.model_runner.kv_caches for cache in layer] for engine in engines)
    size = cold[0].numel() * cold[0].element_size()
    tail = (4 * model_runner.KV_WARM_SLICE, size)
    assert all(_resident_bytes(region, *tail) == 0 for region in cold)
    assert all(_resident_bytes(region, 0, size) == size for region in warm)
    assert engines[1].warm_kv_cache(2**20) == 0
    outputs = []
    for engine in engines:
        engine.add_request("r", [5, 9, 2, 7], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        outputs.append(run_to_completion(engine)["r"].outputs[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12
    with pytest.raises(ValueError, match="warm_kv_cache must be True or False, got 1"):
        EngineArgs.from_kwargs(warm_kv_cache=1).verify()


def test_machine_memory_is_capped_by_the_cgroup_memory_limit(tmp_path):
    """In a container with a memory limit /proc/meminfo shows the node's memory: the KV budget
    must come from the cgroup's limit less its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    from pagedllm.platform import machine_memory

    with open("/proc/meminfo") as f:
        meminfo_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert machine_memory(str(tmp_path))[0] == meminfo_total  # no cgroup files: /proc/meminfo's

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{1 << 30}\n")
    (v2 / "memory.current").write_text(f"{256 << 20}\n")
    total, available = machine_memory(str(v2))
    assert total == min(meminfo_total, 1 << 30) and available <= (1 << 30) - (256 << 20)
    (v2 / "memory.max").write_text("max\n")
    assert machine_memory(str(v2))[0] == meminfo_total

    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{512 << 20}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{600 << 20}\n")
    assert machine_memory(str(tmp_path / "v1")) == (min(meminfo_total, 512 << 20), 0)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert machine_memory(str(tmp_path / "v1"))[0] == meminfo_total


_BUILD_PEAK = """
import json, sys, torch
from pagedllm.huge_pages import release_freed_memory
from pagedllm.layers.quantization import weight_bytes
from pagedllm.models.dummy import load_dummy_checkpoint
from pagedllm.models.loader import build_model

def status_bytes(field):  # this process's own (ru_maxrss would count a forking parent's)
    line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

# A first build loads the libraries and starts the thread pools.
warm_up = build_model(*load_dummy_checkpoint(sys.argv[2], torch.bfloat16), torch.bfloat16, "w4a8")
del warm_up
release_freed_memory()
config, state_dict = load_dummy_checkpoint(sys.argv[1], torch.bfloat16)
before = status_bytes("VmRSS")
model = build_model(config, state_dict, torch.bfloat16, "w4a8")
print(json.dumps({"before": before, "peak": status_bytes("VmHWM"), "resident": status_bytes("VmRSS"),
                  "weights": weight_bytes(model), "float": model.unquantized_weight_bytes}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_quantized_build_holds_one_float_layer_at_a_time(tmp_path):
    """A MoE model built in w4a8 from dummy weights (16 layers of 32 experts, 1.7 GB in bf16):
    the process peaks below its quantized weights plus two float layers and what
    ``move_weights_to_huge_pages`` copies between trims (each layer is quantized as it loads),
    and keeps no freed float pages afterwards (``release_freed_memory``: glibc would otherwise
    keep the freed layers' heap pages resident)."""
    config = json.loads((Path(__file__).resolve().parent.parent / "bench" / "configs"
                         / "Qwen3-30B-A3B.json").read_text())
    config.update(hidden_size=1024, num_hidden_layers=16, num_experts=32, moe_intermediate_size=512,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "one-layer.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    engine_config, _ = load_dummy_checkpoint(str(tmp_path / "config.json"), torch.bfloat16)
    layer_bytes = 2 * sum(torch.Size(shape).numel() for name, shape in hf_weight_shapes(engine_config).items()
                          if name.startswith("model.layers.0."))
    result = json.loads(subprocess.run([sys.executable, "-c", _BUILD_PEAK, str(tmp_path / "config.json"),
                                        str(tmp_path / "one-layer.json")],
                                       check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    slack = 96 << 20
    assert result["float"] > result["weights"] + 2 * layer_bytes + TRIM_BYTES + slack  # the bound can fail
    assert result["peak"] - result["before"] < result["weights"] + 2 * layer_bytes + TRIM_BYTES + slack
    assert result["resident"] - result["before"] < result["weights"] + slack
