"""Builds pagedllm's C++ ops at install time, once per instruction-set variant
(``pagedllm/cpu_isa.py``), into ``pagedllm/_C_<variant>.*.so``; ``pagedllm.layers.ops`` loads
the best one the CPU runs. Everything else about the package is in pyproject.toml.

After editing ``pagedllm/csrc`` in a checkout, rebuild in place:
``.venv/bin/pip install --no-build-isolation -e .`` (or ``python setup.py build_ext --inplace``).
"""

import runpy
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "pagedllm" / "csrc"
isa = runpy.run_path(str(ROOT / "pagedllm" / "cpu_isa.py"))


class BuildPerVariant(BuildExtension):
    """torch's ``BuildExtension`` (ninja, parallel compiles) with one object folder per
    extension: the variants compile the same sources, and a shared folder would let each
    variant's objects overwrite the last one's. The folders are ``build/temp/<extension>``
    in the source tree, whatever temporary folder pip builds in, so ninja recompiles only what
    changed: a wheel built after an editable install (CI's wheel test) only links."""

    def build_extension(self, ext):
        base = self.build_temp
        self.build_temp = str(ROOT / "build" / "temp" / ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


def build_info_source(variant_name: str, digest: str) -> str:
    """Writes (when its text changes) ``build/generated/build_info_<variant>.cpp``, defining
    ``pagedllm::build_info()`` = "<variant> <sha256 of the sources>", and returns its path. A
    file of its own rather than a -D flag: a flag that changes with every edit would recompile
    every source of every variant."""
    path = ROOT / "build" / "generated" / f"build_info_{variant_name}.cpp"
    text = ('#include <string>\n\nnamespace pagedllm {\n'
            f'std::string build_info() {{ return "{variant_name} {digest}"; }}\n}}  // namespace pagedllm\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return str(path.relative_to(ROOT))


sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
digest = isa["sources_digest"](str(CSRC))
extensions = [
    CppExtension(f"pagedllm._C_{variant.name}", sources + [build_info_source(variant.name, digest)],
                 extra_compile_args=["-O3", "-g0", "-fopenmp", *variant.cflags],
                 extra_link_args=["-fopenmp"])
    for variant in isa["built_variants"]()
]

setup(ext_modules=extensions, cmdclass={"build_ext": BuildPerVariant})
