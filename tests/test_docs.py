"""The documentation site builds with no warning, its generated pages are what their generators
print now, and every ``PAGEDLLM_*`` variable is declared once, in ``pagedllm/envs.py``."""

import ast
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import envs

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict(tmp_path):
    """mkdocs.yml's validation turns a broken link or anchor and a page missing from the nav into
    warnings; --strict makes a warning fail the build."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "site" / "environment-variables" / "index.html").is_file()
    assert (tmp_path / "site" / "cli" / "index.html").is_file()


@pytest.mark.parametrize("generator, page", [("gen_cli.py", "cli.md"), ("gen_envs.py", "environment-variables.md")])
def test_generated_page_is_current(generator, page, capsys):
    runpy.run_path(str(ROOT / "docs" / generator))["main"]()
    generated = capsys.readouterr().out
    assert (ROOT / "docs" / page).read_text() == generated, \
        f"regenerate: .venv/bin/python docs/{generator} > docs/{page}"


def test_every_pagedllm_variable_in_a_tracked_file_is_declared():
    declared = {variable.name for variable in envs.ENVIRONMENT_VARIABLES}
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    used = {}
    for name in files:
        path = ROOT / name
        # C++ sources: PAGEDLLM_* there are preprocessor macros, not environment variables.
        if path.suffix in (".png", ".jpg", ".cpp", ".h") or not path.is_file():
            continue
        for found in re.findall(r"\bPAGEDLLM_[A-Z0-9]+(?:_[A-Z0-9]+)*", path.read_text(errors="replace")):
            used.setdefault(found, name)
    undeclared = {variable: name for variable, name in used.items() if variable not in declared}
    assert not undeclared, f"declare these in pagedllm/envs.py (first file naming each): {undeclared}"


def _environment_reads(tree: ast.AST):
    """``os.environ.get(NAME)``, ``os.getenv(NAME)`` and ``os.environ[NAME]`` reads of a constant
    name in ``tree`` (writes, as in ``dict(os.environ, PAGEDLLM_ISA=...)``, are not reads)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = ast.unparse(node.func)
            if function in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                yield node.args[0].value, node.lineno
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and \
                ast.unparse(node.value) in ("os.environ", "environ") and isinstance(node.slice, ast.Constant):
            yield node.slice.value, node.lineno


def test_code_reads_pagedllm_variables_only_through_envs():
    offenders = []
    for path in sorted((ROOT / "pagedllm").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py")):
        if path == ROOT / "pagedllm" / "envs.py":
            continue
        for name, line in _environment_reads(ast.parse(path.read_text())):
            if isinstance(name, str) and name.startswith("PAGEDLLM_"):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, "read these as envs.NAME (pagedllm/envs.py):\n" + "\n".join(offenders)


def test_envs_parse_values_and_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDLLM_NATIVE_OPS", raising=False)
    assert envs.PAGEDLLM_NATIVE_OPS is True
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "0")
    assert envs.PAGEDLLM_NATIVE_OPS is False
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "TRUE")
    assert envs.PAGEDLLM_NATIVE_OPS is True
    monkeypatch.setenv("PAGEDLLM_NATIVE_OPS", "yes please")
    with pytest.raises(ValueError, match=r"PAGEDLLM_NATIVE_OPS='yes please': expected 0 or 1"):
        envs.PAGEDLLM_NATIVE_OPS
    monkeypatch.setenv("PAGEDLLM_TP_TIMEOUT_S", "2.5")
    assert envs.PAGEDLLM_TP_TIMEOUT_S == 2.5
    monkeypatch.setenv("PAGEDLLM_TP_TIMEOUT_S", "two")
    with pytest.raises(ValueError, match=r"PAGEDLLM_TP_TIMEOUT_S='two': expected a float"):
        envs.PAGEDLLM_TP_TIMEOUT_S
    monkeypatch.setenv("PAGEDLLM_PACK_WEIGHTS", "")
    assert envs.PAGEDLLM_PACK_WEIGHTS is None  # empty is unset: by CPU and dtype
    monkeypatch.delenv("PAGEDLLM_CACHE_DIR", raising=False)
    monkeypatch.delenv("PAGEDLLM_PEERS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.PAGEDLLM_CACHE_DIR == tmp_path / ".cache" / "pagedllm"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert envs.PAGEDLLM_PEERS_DIR == tmp_path / "cache" / "peers"
    with pytest.raises(AttributeError):
        getattr(envs, "PAGEDLLM_" + "NOT_DECLARED")  # split: the test above would find the name


def test_manifests_name_the_images_deploy_dockerfile_builds():
    """Every ``image:`` of deploy/kubernetes (the Deployment, KubeRay's pods) is a tag that
    deploy/Dockerfile's usage lines build, and deploy/build_and_smoke.sh builds the Deployment's."""
    built = set(re.findall(r"docker build -f deploy/Dockerfile .*?-t (\S+) \.", (ROOT / "deploy" / "Dockerfile").read_text()))
    named = {}
    for manifest in sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml")):
        for image in re.findall(r"^\s*image:\s*(\S+)", manifest.read_text(), flags=re.M):
            named[image] = manifest.relative_to(ROOT)
    assert named and set(named) <= built, (named, built)
    assert "IMAGE=${IMAGE:-pagedllm:0.1.0}" in (ROOT / "deploy" / "build_and_smoke.sh").read_text()
    assert "pagedllm:0.1.0" in named and "pagedllm-ray:0.1.0" in named
