"""The converted-model cache: one conversion per GGUF content, no partial folders left behind."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedllm.models import loader


def test_content_key_ignores_the_path_but_not_the_content(tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "model.gguf").write_bytes(data)
    (tmp_path / "b" / "model.gguf").write_bytes(data)
    key = loader._content_key(tmp_path / "a" / "model.gguf")
    assert key == loader._content_key(tmp_path / "b" / "model.gguf")
    changed = tmp_path / "b" / "model.gguf"
    changed.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same name and size, last byte differs
    assert loader._content_key(changed) != key


def test_abandoned_conversion_folders_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    abandoned = tmp_path / f"model-0123.tmp{dead.stdout.strip()}"
    running = tmp_path / f"model-4567.tmp{os.getpid()}"
    finished = tmp_path / "model-89ab"
    for folder in (abandoned, running, finished):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    loader._remove_abandoned_conversions(tmp_path)
    assert not abandoned.exists() and running.exists() and finished.exists()


def test_conversions_by_older_versions_are_removed(tmp_path):
    """A new conversion deletes the same file's conversions by older converters (each a full
    fp32 copy of the model), and leaves other files' and newer ones alone."""
    def conversion(name, source, version):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "complete").write_text(f"/some/venv/{source}")
        if version is not None:
            (folder / "conversion_version").write_text(str(version))
        return folder

    current = conversion("model-0000", "model.gguf", loader._CONVERSION_VERSION)
    unversioned = conversion("model-1111", "model.gguf", None)
    older = conversion("model-2222", "model.gguf", loader._CONVERSION_VERSION - 1)
    newer = conversion("model-3333", "model.gguf", loader._CONVERSION_VERSION + 1)
    other_file = conversion("model-4444", "model-v2.gguf", None)
    unfinished = tmp_path / "model-5555"
    unfinished.mkdir()
    loader._remove_older_conversions(current, "model.gguf")
    assert not unversioned.exists() and not older.exists()
    assert current.exists() and newer.exists() and other_file.exists() and unfinished.exists()
