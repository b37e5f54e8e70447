"""The machine this process runs on, read and tuned in one place: CPU flags and name, memory
(the machine's, a cgroup's limit, a process's resident set), NUMA nodes, thread placement, and
the allocator settings the engine runs under.

Everything is read from Linux's ``/proc`` and ``/sys`` where they exist; each function says what
it returns where they do not. The ``PAGEDLLM_*`` variables are read through ``envs.py``, the
C++ ops' variant choice is ``cpu_isa.py``'s (over ``cpu_flags``). Nothing here imports from
pagedllm.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import platform as std_platform
import re
from typing import Optional

import torch


def _cpuinfo_line(*keys: str) -> Optional[str]:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``keys`` (None where
    there is none, or the file cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(keys)), None)
    except OSError:
        return None
    return None if line is None else line.partition(":")[2].strip()


# torch's CPUID checks (its cpuinfo library: what this process can execute) that the flags of
# /proc/cpuinfo must pass: the kernel reports the host's flags to a process that runs under an
# emulator (qemu-user with an AVX2-only CPU model), which would fault on AVX-512 code.
_CPUID_CHECKS = (("avx512", "_is_avx512_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"),
                 ("avx512_vnni", "_is_vnni_supported"), ("amx", "_is_amx_tile_supported"),
                 ("avx2", "_is_avx2_supported"))


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s ``flags``, ``Features`` on Arm; empty where
    it cannot be read). On x86 a flag family that torch's CPUID check says this process cannot
    execute is dropped: ``avx512*`` (``avx512_bf16``, ``avx512_vnni`` each on its own
    check), ``amx*``, ``avx2``."""
    flags = set((_cpuinfo_line("flags", "Features") or "").split())
    for prefix, check in _CPUID_CHECKS:
        supported = getattr(torch.cpu, check, None)
        if supported is not None and not supported():
            flags = {flag for flag in flags if not flag.startswith(prefix)}
    return frozenset(flags)


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...; "" if unknown)."""
    return _cpuinfo_line("vendor_id") or ""


def cpu_model_name() -> str:
    """The CPU's ``model name`` (/proc/cpuinfo), else ``platform.processor()``, else "unknown"."""
    return _cpuinfo_line("model name") or std_platform.processor() or "unknown"


def machine_memory(cgroup_dir: str = "/sys/fs/cgroup") -> tuple[int, int]:
    """``(total, available)`` bytes of memory this process may use: /proc/meminfo's, capped by its
    cgroup's memory limit less the cgroup's usage where a limit is set (cgroup v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``). In a container with a memory limit (a Kubernetes pod's
    ``limits.memory``, ``docker run --memory``) /proc/meminfo shows the node's memory, and a KV
    pool sized from it is OOM-killed.

    Raises:
        OSError: no /proc/meminfo (not Linux).
    """
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024
    total, available = values["MemTotal"], values.get("MemAvailable", values["MemFree"])
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(cgroup_dir, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(cgroup_dir, usage_file)) as f:
                usage = int(f.read())
        except (OSError, ValueError):
            continue
        if limit != "max":  # v1's "no limit" is a huge number, which min() leaves out
            total, available = min(total, int(limit)), min(available, max(0, int(limit) - usage))
        break
    return total, available


def _status_bytes(field: str, pid: Optional[int]) -> Optional[int]:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes (None where it cannot be read)."""
    try:
        with open(f"/proc/{os.getpid() if pid is None else pid}/status") as f:
            line = next((line for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) * 1024


def process_rss_bytes(pid: Optional[int] = None) -> int:
    """Resident set size (``VmRSS``) of process ``pid`` (default: this one) in bytes; 0 where
    it cannot be read (the process ended, or not Linux)."""
    return _status_bytes("VmRSS", pid) or 0


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (``VmHWM``; writes 5 to
    /proc/self/clear_refs). Returns False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> Optional[int]:
    """This process's peak resident set size (``VmHWM``) in bytes since it started or since
    ``reset_peak_rss``; None where it cannot be read."""
    return _status_bytes("VmHWM", None)


def parse_cpu_list(text: str) -> list[int]:
    """A Linux CPU list (``0-3,8,10-11``, as in /sys/devices/system/node/node0/cpulist) as CPU ids.

    Raises:
        ValueError: not such a list.
    """
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        if not first.strip().isdigit() or last and not last.strip().isdigit():
            raise ValueError(f"not a CPU list (like '0-3,8'): {text!r}")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(allowed: Optional[set[int]] = None) -> list[list[int]]:
    """The CPUs of each NUMA node (/sys/devices/system/node), in node order, restricted to
    ``allowed`` (default: the CPUs this process may run on); nodes left without a CPU are left
    out. Empty where sysfs has no nodes."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"),
                       key=lambda p: int(re.findall(r"node(\d+)/", p)[-1])):
        with open(path) as f:
            text = f.read().strip()
        cpus = [cpu for cpu in parse_cpu_list(text) if cpu in allowed] if text else []
        if cpus:
            nodes.append(cpus)
    return nodes


def pin_threads(cpus: list[int]) -> None:
    """Run this process (its OpenMP pool included) on ``cpus``, one torch thread per CPU."""
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


ONEDNN_CACHE_CAPACITY = 128


def bound_onednn_caches() -> None:
    """Keep at most ``ONEDNN_CACHE_CAPACITY`` oneDNN matmuls per cache (defaults: 1024).

    A bfloat16 ``torch.mm`` runs through oneDNN, which builds one primitive (JIT code and
    scratchpad, ~0.3 MB) per (rows, weight shape) and keeps it in two LRU caches: oneDNN's own
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's (``LRU_CACHE_CAPACITY``). A server's
    batches have ever new row counts (running sequences, prefill chunks), so both fill up:
    under the soak of issue 19 (SmolLM2 bf16, 43-block pool) RSS rose from 698 to 1,479 MiB
    over 2,100 requests, with malloc's in-use bytes growing alike and Python's objects flat;
    a bf16 ``torch.mm`` over 4 weight shapes at random row counts (1-300) alone went from 87
    to 672 MiB in use, 158 MiB with both capacities at 128. A miss costs ~0.6 ms per weight
    shape, once per step whose row count is new; 128 entries still hold every shape of the
    last ~25 row counts. Both are read at the first oneDNN matmul of the process, so this has
    no effect when one ran earlier; a value already in the environment is kept
    (``LRU_CACHE_CAPACITY=0`` crashes ideep, so use 1 or more).
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


@functools.lru_cache(maxsize=1)
def keep_freed_memory_mapped() -> None:
    """Make glibc malloc reuse freed activation memory instead of returning it to the OS.

    By default glibc serves allocations above a (dynamic) threshold with fresh ``mmap``s and
    unmaps them on free, so every large activation of every step page-faults anew and the
    kernel zeroes it: measured on a 2048-token prefill step of SmolLM2 (fp32, 1 thread)
    ~370k page faults and ~1.3 s of the step's 5.9 s CPU time, gone with these settings.
    (vLLM's CPU backend preloads tcmalloc for the same reason.) Tensors above 32 MiB (glibc's
    cap on the threshold), such as the KV cache, still get their own lazily mapped pages.
    A no-op where the C library has no ``mallopt``.
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
    if mallopt is None:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 32 * 2**20)
    mallopt(m_trim_threshold, 2**30)
    mallopt(m_top_pad, 64 * 2**20)


def tune_allocator() -> None:
    """The memory settings a model runner works under: ``keep_freed_memory_mapped`` and
    ``bound_onednn_caches``. Call before the process's first matmul."""
    keep_freed_memory_mapped()
    bound_onednn_caches()
