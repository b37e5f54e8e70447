"""The C++ ops library, and the dispatch of every op between it and its torch twin.

The ops of ``pagedllm/csrc`` are compiled when the package is built (``setup.py``), once per
instruction-set variant of ``pagedllm/cpu_isa.py``; ``native_ops()`` loads the variant this
CPU runs best (or the one ``PAGEDLLM_ISA`` names), once per process. A library that cannot be
loaded is reported once, when loading is first tried, as a warning naming the reason; every op
then runs its torch twin (``pagedllm serve`` refuses to start instead, see
``native_ops_error``).

Every C++ op has a torch formulation computing the same values. A ``CustomOp`` holds the two,
as vLLM's ``vllm/model_executor/custom_op.py`` does: ``forward_native`` (torch: the reference
the tests compare the C++ against, and the path ``PAGEDLLM_NATIVE_OPS=0`` asks for) and
``forward_cpu`` (the C++ op). Calling the op runs the one ``dispatch_forward`` chose at its
first call, so no call site asks which path it is on.
"""

from __future__ import annotations

import functools
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pagedllm import cpu_isa, envs

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent.parent
CSRC = PACKAGE_DIR / "csrc"
NATIVE_OPS_ENV = "PAGEDLLM_NATIVE_OPS"


class NativeOpsUnavailable(RuntimeError):
    """The C++ ops cannot be loaded; the message says why and how to fix it."""


def library_path(variant: cpu_isa.IsaVariant) -> Path:
    """The built library of ``variant``, ``pagedllm/_C_<name>.<python ABI tag>.so``.

    Raises:
        NativeOpsUnavailable: it was not built (a checkout used without ``pip install``).
    """
    found = sorted(PACKAGE_DIR.glob(f"_C_{variant.name}.*so"))
    if not found:
        raise NativeOpsUnavailable(
            f"pagedllm/_C_{variant.name}.*.so is not built; build the C++ ops with "
            f"`pip install --no-build-isolation -e .` in the checkout, or run {NATIVE_OPS_ENV}=0 for the torch path")
    return found[0]


@functools.lru_cache(maxsize=1)
def load_native_ops() -> Any:
    """Load the C++ ops built for this CPU and return ``torch.ops.pagedllm``.

    One variant per process: every variant registers the same ``torch.ops.pagedllm``
    names, so a process that loaded one cannot load another (the tests run each variant in a
    subprocess).

    Raises:
        NativeOpsUnavailable: no variant runs on this CPU, ``PAGEDLLM_ISA`` names one it cannot
            run, the library is missing, or it was built from other sources than
            ``pagedllm/csrc`` (a checkout edited after its build).
    """
    try:
        variant = cpu_isa.select_variant()
    except ValueError as exc:
        raise NativeOpsUnavailable(str(exc)) from None
    torch.ops.load_library(str(library_path(variant)))
    built_isa, _, built_digest = torch.ops.pagedllm.build_info().partition(" ")
    if CSRC.is_dir() and built_digest != cpu_isa.sources_digest(str(CSRC)):
        raise NativeOpsUnavailable(
            f"pagedllm's C++ ops ({built_isa}) were built from other sources than {CSRC}; rebuild them "
            "with `pip install --no-build-isolation -e .`")
    logger.info("C++ ops: the %s build", built_isa)
    return torch.ops.pagedllm


def native_ops_error() -> Optional[str]:
    """Why the C++ ops cannot be used (None when they can, or when ``PAGEDLLM_NATIVE_OPS=0``
    asked for the torch path)."""
    if not envs.PAGEDLLM_NATIVE_OPS:
        return None
    try:
        load_native_ops()
    except (NativeOpsUnavailable, OSError, RuntimeError) as exc:
        return str(exc)
    return None


class _NativeOps:
    """``native_ops()``: the compiled ops (``torch.ops.pagedllm``), or None: with
    ``PAGEDLLM_NATIVE_OPS=0``, or where they cannot be loaded (one warning says why;
    ``pagedllm serve`` refuses to start then, see ``native_ops_error``). Chosen at the first
    call and kept for the process; ``native_ops.cache_clear()`` chooses again at the next call,
    and every ``CustomOp`` with it (tests switch ``PAGEDLLM_NATIVE_OPS`` inside one process).

    Raises:
        ValueError: ``PAGEDLLM_ISA`` names no variant, or one this CPU cannot run: a variant
            asked for by name is never replaced by the torch path without a word.
    """

    def __init__(self) -> None:
        self._chosen = False
        self._library: Any = None

    def __call__(self) -> Any:
        if not self._chosen:
            self._library = self._choose()
            self._chosen = True
        return self._library

    @staticmethod
    def _choose() -> Any:
        if not envs.PAGEDLLM_NATIVE_OPS:
            return None
        if envs.PAGEDLLM_ISA:
            cpu_isa.select_variant()
        error = native_ops_error()
        if error is not None:
            logger.warning("pagedllm's C++ ops cannot be loaded (%s); using the pure-torch path: every op runs "
                           "its torch twin, several times slower. %s=0 chooses that path without this warning",
                           error, NATIVE_OPS_ENV)
            return None
        return load_native_ops()

    def cache_clear(self) -> None:
        self._chosen, self._library = False, None
        for op in list(CustomOp.instances):
            op.redispatch()


native_ops = _NativeOps()


class CustomOp:
    """One op with two implementations; calling it runs the one chosen at the first call.

    ``forward_native`` is the torch formulation (given to the constructor, or a subclass's
    method); ``forward_cpu`` calls ``torch.ops.pagedllm.<name>`` (a subclass overrides it where
    some arguments need the torch path, e.g. a shape the kernel does not take). Both take the
    same arguments and return the same values (fp32 results up to summation order).
    ``dispatch_forward`` picks ``forward_cpu`` when ``native_ops()`` is loaded, else
    ``forward_native``; where ``forward_cpu`` is the plain C++ op, the op itself is bound, so a
    call costs one Python frame over calling it directly.

    Attributes:
        name: the op's name in ``torch.ops.pagedllm`` (``csrc/ops.h``).
        instances: every op built (weakly held), for ``native_ops.cache_clear``.
    """

    instances: "weakref.WeakSet[CustomOp]" = weakref.WeakSet()

    def __init__(self, name: str, forward_native: Optional[Callable[..., Any]] = None) -> None:
        self.name = name
        if forward_native is not None:
            self.forward_native = forward_native  # type: ignore[method-assign]
            if type(self) is CustomOp:
                self.__doc__ = forward_native.__doc__
        self._forward_method: Callable[..., Any] = self._dispatch_and_run
        CustomOp.instances.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} {self.name!r} has no torch formulation")

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """The C++ op. Raises ``NativeOpsUnavailable`` (with the reason) where the library
        cannot be loaded."""
        return getattr(load_native_ops(), self.name)(*args, **kwargs)

    def dispatch_forward(self) -> Callable[..., Any]:
        """``forward_cpu`` (or the C++ op itself) where the library is loaded, else ``forward_native``.

        Raises:
            ValueError: ``PAGEDLLM_ISA`` names a variant this CPU cannot run (``native_ops``).
        """
        library = native_ops()
        if library is None:
            return self.forward_native
        if type(self).forward_cpu is CustomOp.forward_cpu:
            return getattr(library, self.name)
        return self.forward_cpu

    def redispatch(self) -> None:
        """Choose again at the next call."""
        self._forward_method = self._dispatch_and_run

    def _dispatch_and_run(self, *args: Any, **kwargs: Any) -> Any:
        self._forward_method = self.dispatch_forward()
        return self._forward_method(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
