"""The package layers point one way, and modules stay small enough to read.

    messages  <-  common  <-  agent, coordinator (side by side)  <-  cli

Every import of every module is read from its source (imports inside functions
included), so an arrow pointing the wrong way fails here, not in review.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("messages", "common", "agent", "coordinator", "cli")
# What each layer may import from revenant (itself always).
ALLOWED = {
    "messages": set(),
    "common": {"messages"},
    "agent": {"messages", "common"},
    "coordinator": {"messages", "common"},
    "cli": {"messages", "common", "agent", "coordinator"},
}
# Benchmarks aside, no module in these packages grows past about a few screens.
SMALL = ("agent", "common", "coordinator", "cli")
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 85


def modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).glob("*.py"))


def revenant_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, layer) of every ``revenant.<layer>`` import in the module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        for name in names:
            parts = name.split(".")
            if parts[0] == "revenant" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_the_layers(package):
    wrong = [f"{package}/{path.name}:{line} imports revenant.{layer}"
             for path in modules(package)
             for line, layer in revenant_imports(path)
             if layer != package and layer not in ALLOWED[package]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_layer_test_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from revenant.agent.health import evaluate\n")
    assert revenant_imports(bad) == [(2, "agent")]


@pytest.mark.parametrize("package", SMALL)
def test_modules_and_functions_stay_small(package):
    long = []
    for path in modules(package):
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            long.append(f"{package}/{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{package}/{path.name}:{node.lineno} {node.name}() is {length} lines")
    assert not long, "split these:\n" + "\n".join(long)


def module_imports(path: pathlib.Path) -> set[str]:
    """The revenant modules a module imports (``revenant.agent.epochs``), anywhere in it: inside
    functions and under TYPE_CHECKING as well, since a circle there is a circle to a reader."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("revenant."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("revenant."):
            for a in node.names:  # "from revenant.agent import epochs" names a module
                sub = f"{node.module}.{a.name}"
                out.add(sub if (ROOT / pathlib.Path(*sub.split(".")[1:])).with_suffix(".py").exists() else node.module)
    return out


def import_circles() -> list[list[str]]:
    """Every import circle between the packages' modules, each once, as the modules around it."""
    graph = {f"revenant.{p}.{m.stem}": module_imports(m) for p in PACKAGES for m in modules(p)}
    circles, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                circle = path[path.index(nxt):]
                key = frozenset(circle)
                if key not in seen:
                    seen.add(key)
                    circles.append(circle)
            elif nxt in graph and nxt not in done:
                walk(nxt, [*path, nxt])
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            walk(start, [start])
    return circles


def test_no_module_imports_itself_around_a_circle():
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n".join(" -> ".join([*c, c[0]]) for c in circles)


def test_the_circle_check_sees_a_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "agent"
    pkg.mkdir()
    (pkg / "a.py").write_text("from revenant.agent import b\n")
    (pkg / "b.py").write_text("def f():\n    from revenant.agent.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("agent",))
    assert import_circles() == [["revenant.agent.a", "revenant.agent.b"]]
