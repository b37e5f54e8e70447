"""The package's structure, read from its own imports (docs/gen_structure.py): no import
cycle, no import from a higher layer, and docs/structure.md drawn from the code as it is."""

import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
sys.path.insert(0, str(DOCS))
import gen_structure  # noqa: E402


@pytest.fixture(scope="module")
def graph():
    return gen_structure.import_graph()


def test_no_module_imports_itself_around_a_cycle(graph):
    assert gen_structure.cycles(graph) == []


def test_no_import_points_up_a_layer(graph):
    upward = [(a, gen_structure.LAYERS[gen_structure.layer_of(a)][0], b, gen_structure.LAYERS[gen_structure.layer_of(b)][0])
              for a, b in gen_structure.upward_imports(graph)]
    assert upward == []


def test_the_checker_sees_cycles_and_upward_imports():
    """The two checks on a made-up graph: a cycle through three modules, an upward import."""
    made_up = {"pagedllm.core.a": {"pagedllm.core.b"}, "pagedllm.core.b": {"pagedllm.core.c"},
               "pagedllm.core.c": {"pagedllm.core.a", "pagedllm.engine.x"}, "pagedllm.engine.x": set()}
    assert gen_structure.cycles(made_up) == [["pagedllm.core.a", "pagedllm.core.b", "pagedllm.core.c"]]
    assert gen_structure.upward_imports(made_up) == [("pagedllm.core.c", "pagedllm.engine.x")]


def test_type_checking_imports_are_not_edges(tmp_path, monkeypatch):
    package = tmp_path / "pagedllm"
    (package / "core").mkdir(parents=True)
    (package / "engine").mkdir()
    for path in (package / "__init__.py", package / "core" / "__init__.py", package / "engine" / "__init__.py"):
        path.write_text("")
    (package / "engine" / "x.py").write_text("")
    (package / "core" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm.engine.x import X\n"
        "def f():\n    from pagedllm.engine import x\n")
    monkeypatch.setattr(gen_structure, "ROOT", package)
    assert gen_structure.import_graph()["pagedllm.core.a"] == {"pagedllm.engine.x"}


def test_structure_page_is_current(capsys):
    gen_structure.main()
    assert (DOCS / "structure.md").read_text() == capsys.readouterr().out, \
        "docs/structure.md is stale: .venv/bin/python docs/gen_structure.py > docs/structure.md"
