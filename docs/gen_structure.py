"""Print docs/structure.md: pagedllm's layers and the imports between its packages, read from
the code itself (every ``import`` statement, at module level or inside a function; imports
under ``if TYPE_CHECKING:`` are left out, as they never run). Regenerate with

    .venv/bin/python docs/gen_structure.py > docs/structure.md

tests/test_structure.py fails when the page differs from this output, when two modules import
each other (directly or around a cycle), or when a package imports one of a higher layer.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pagedllm"

# Low to high. A module belongs to the layer of its longest listed prefix; a module may
# import its own layer and the layers below, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("pagedllm.version", "pagedllm.data", "pagedllm.envs", "pagedllm.utils", "pagedllm.platform", "pagedllm.cpu_isa",
                    "pagedllm.huge_pages", "pagedllm.config", "pagedllm.sampling_params", "pagedllm.outputs",
                    "pagedllm.structured_output", "pagedllm.lora.request")),
    ("core: scheduling policy and block bookkeeping", ("pagedllm.core",)),
    ("layers and collectives", ("pagedllm.layers", "pagedllm.distributed")),
    ("models and adapters", ("pagedllm.models", "pagedllm.lora")),
    ("worker: one rank's model runner, sampler, drafts", ("pagedllm.worker", "pagedllm.spec_decode")),
    ("executor", ("pagedllm.executor",)),
    ("engine and its Prometheus metrics", ("pagedllm.engine", "pagedllm.metrics")),
    ("front ends in Python, tools", ("pagedllm.llm", "pagedllm.beam_search", "pagedllm.planner",
                                     "pagedllm.benchmarks")),
    ("HTTP server", ("pagedllm.entrypoints",)),
    ("replicas", ("pagedllm.serve_ray",)),
    ("command line and package", ("pagedllm.entrypoints.cli", "pagedllm")),
]


def module_names() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name in modules)
            elif isinstance(child, ast.ImportFrom) and child.module in modules:
                submodules = [f"{child.module}.{alias.name}" for alias in child.names
                              if f"{child.module}.{alias.name}" in modules]
                found.update(submodules)
                if len(submodules) < len(child.names):  # a name defined in the module itself
                    found.add(child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the pagedllm modules it imports."""
    modules = module_names()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _prefix(module: str) -> tuple[int, str]:
    """``(layer index, prefix)`` of the longest prefix in ``LAYERS`` naming ``module``."""
    best: tuple[int, str] = (-1, "")
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (index, prefix)
    if best[0] < 0:
        raise ValueError(f"module {module} is in no layer of docs/gen_structure.py")
    return best


def layer_of(module: str) -> int:
    """Index in ``LAYERS`` of the longest prefix naming ``module``."""
    return _prefix(module)[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` pairs where the imported module sits in a higher layer."""
    return sorted((a, b) for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))


def _group(module: str) -> str:
    """The part a module is drawn under: its prefix in ``LAYERS``, without ``pagedllm.``."""
    prefix = _prefix(module)[1]
    return prefix.removeprefix("pagedllm.") if prefix != "pagedllm" else "pagedllm (__init__)"


def main() -> None:
    graph = import_graph()
    edges: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    members: dict[int, set[str]] = collections.defaultdict(set)
    for module, deps in graph.items():
        members[layer_of(module)].add(_group(module))
        for dep in deps:
            if _group(dep) != _group(module):
                edges[_group(module)][_group(dep)] += 1
    lines = ["# Structure", "",
             "<!-- generated by docs/gen_structure.py from the code's own imports; do not edit by hand -->", "",
             "pagedllm's layers, highest first, and what each part imports (number of module-to-module "
             "imports in brackets). A part imports only from its own layer or the layers below it, and no "
             "modules import each other around a cycle (`tests/test_structure.py`). Imports that only "
             "serve type annotations (`if TYPE_CHECKING:`) are not drawn.", "", "```"]
    for index in reversed(range(len(LAYERS))):
        name = LAYERS[index][0]
        lines.append(f"{index:2}  {name}")
        for group in sorted(members[index]):
            targets = ", ".join(f"{target} ({count})" for target, count in
                                sorted(edges[group].items(), key=lambda item: (-layer_of_group(item[0]), item[0])))
            lines.append(f"      {group:20} -> {targets}" if targets else f"      {group}")
        if index:
            lines.append("      " + "-" * 20 + " imports only point down " + "-" * 20)
    lines.append("```")
    print("\n".join(lines))


def layer_of_group(group: str) -> int:
    return layer_of("pagedllm" if group == "pagedllm (__init__)" else f"pagedllm.{group}")


if __name__ == "__main__":
    main()
