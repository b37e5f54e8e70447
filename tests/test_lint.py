"""ruff and mypy (pinned in the test extra, configured in pyproject.toml) find nothing. ruff: pyflakes'
errors (unused imports and variables, undefined names) and pycodestyle's E4/E7/E9."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "pagedllm", "tests",
                             "bench", "docs", "setup.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_is_clean(tmp_path):
    """mypy (pinned in the test extra) on the modules ``[tool.mypy] files`` in pyproject.toml lists."""
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
