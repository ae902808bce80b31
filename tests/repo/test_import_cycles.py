"""No import cycle among our own Python modules in launch/, bench/ and tools/: an import inside a
function counts as much as one at the top (it is a cycle all the same, only deferred). Read with
the standard library's ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("launch", "bench", "tools")


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py file under the folders (a package is its __init__)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours this one imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def ours(target: str) -> str | None:
        """The module of ours that target names (a.b.func -> a.b), if any."""
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found = [ours(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b` imports the module a.b where there is one, else a name of a.
            found = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else ours(base)
                for alias in node.names
            ]
        else:
            continue
        out.update(f for f in found if f and f != name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def test_no_import_cycle_in_launch_bench_tools():
    found = cycles(graph())
    assert not found, "import cycles (each line: modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_the_cycle_finder_sees_a_cycle_and_a_deferred_import(tmp_path):
    """The check itself: two modules that import each other, one of them inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from .a import other\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    known = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    known["pkg.c"] = pkg / "c.py"
    edges = {name: imports(name, path, set(known)) for name, path in known.items()}
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"}
    assert edges["pkg.c"] == {"pkg.a"}
    assert cycles(edges) == [["pkg.a", "pkg.b"]]
