"""The package's modules import one another without a circle, counting the imports inside functions
(which hide a circle from Python but not from a reader): dependencies point one way, front ends (cli,
onnx, torch) → build → schedules and passes → IR builders → spec. Read from the source (AST), as the
package maps its folders (pyproject's package-dir); imports under ``if TYPE_CHECKING:`` never run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"": "tvmattn", "compiler": "tvmattn.compiler", "schedules": "tvmattn.schedules",
           "models": "tvmattn.models", "pytorch": "tvmattn.torch"}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    found = {"tvmattn": ROOT / "__init__.py"}
    for folder, package in FOLDERS.items():
        if not folder:
            continue
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, anywhere in it but under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    skipped = {id(n) for node in guarded for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or ({node.module} & known)
            if len(subs) < len(node.names) and node.module in known:
                out.add(node.module)  # a name defined in the module itself
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: its strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    mods = modules()
    graph = {name: imports(path, set(mods)) - {name} for name, path in mods.items()}
    assert cycles(graph) == []


def test_the_check_sees_a_circle():
    """The check can fail: a circle hidden in a function is found, and so is one through a package."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = "def f():\n    from tvmattn.compiler import build\nif TYPE_CHECKING:\n    import tvmattn.compiler.spec\n"
    path = ROOT / "tests" / "_imports_probe.py"
    try:
        path.write_text(source)
        assert imports(path, {"tvmattn.compiler.build", "tvmattn.compiler.spec", "tvmattn.compiler"}) == {
            "tvmattn.compiler.build"}
    finally:
        path.unlink()
