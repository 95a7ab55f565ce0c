"""No import circle of more than two modules in ``src/polykernel`` (issue 36).

``lint-imports`` checks the layers and the backends' independence, but only for imports made at
module level; a circle can also be held open by an import inside a function (run on first use).
The first check reads every import statement of the package (module level and inside functions;
not those under ``if TYPE_CHECKING:``, which never run), resolves it to the module it loads,
counting the packages a dotted import passes through, and looks for strongly connected
components. The second takes grimp's graph (import-linter's), which counts the imports under
``if TYPE_CHECKING:`` too, as ``exclude_type_checking_imports = false`` in pyproject.toml does: no
circle of type names either (a lower layer annotates with :mod:`polykernel.core.protocols`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in (root / "polykernel").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The polykernel modules an import statement in ``module`` names (a name imported from a
    module is that module, unless it is a submodule itself)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "polykernel"]
    if node.level:
        package = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, node.module] if node.module else package)
    else:
        base = node.module or ""
    if base.split(".")[0] != "polykernel":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing_only:
                continue
            for target in _targets(module, node, modules):
                while target not in modules and "." in target:  # an attribute of a module: the module
                    target = target.rpartition(".")[0]
                # the module, and the packages between the root and it (each one's __init__ runs)
                while target.count(".") >= 1:
                    if target in modules and target != module and not module.startswith(target + "."):
                        edges[module].add(target)
                    target = target.rpartition(".")[0]
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def grimp_graph(package: str) -> dict[str, set[str]]:
    """``package``'s imports as grimp finds them, those under ``if TYPE_CHECKING:`` included."""
    grimp = pytest.importorskip("grimp")  # installed with import-linter (the dev extra)
    graph = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def _shown(big: list[list[str]]) -> str:
    return "\n".join(" <-> ".join(c) for c in big)


def test_no_import_circle_of_more_than_two_modules():
    big = [c for c in circles(import_graph(_modules())) if len(c) > 2]
    assert not big, "import circles of more than two modules:\n" + _shown(big)


def test_no_circle_of_more_than_two_modules_counting_type_checking_imports():
    big = [c for c in circles(grimp_graph("polykernel")) if len(c) > 2]
    assert not big, "import circles of more than two modules, TYPE_CHECKING imports counted:\n" + _shown(big)


def _three_modules(root, name: str, c_source: str):
    """A package ``name`` under ``root``: a imports sub.b, sub.b imports c, c is ``c_source``."""
    pkg = root / name
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(f"from {name} import c\n")
    (pkg / "c.py").write_text(c_source)
    return pkg


def test_the_check_finds_a_circle_held_open_inside_a_function(tmp_path):
    # three modules in a circle, one link an import inside a function, one under TYPE_CHECKING
    # (which does not count): the circle a -> b -> c -> a is found, and only while c's import runs
    pkg = _three_modules(tmp_path, "polykernel", "def f():\n    from . import a\n    return a\n")
    modules = _modules(tmp_path)
    assert circles(import_graph(modules)) == [["polykernel.a", "polykernel.c", "polykernel.sub.b"]]
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert circles(import_graph(_modules(tmp_path))) == []


def test_the_grimp_check_finds_a_circle_closed_by_a_type_checking_import(tmp_path, monkeypatch):
    # the same three modules, the circle closed by an import under TYPE_CHECKING: found here
    _three_modules(tmp_path, "circle_probe_pkg", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = [c for c in circles(grimp_graph("circle_probe_pkg")) if len(c) > 2]
    assert found == [["circle_probe_pkg.a", "circle_probe_pkg.c", "circle_probe_pkg.sub.b"]]
