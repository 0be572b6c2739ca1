"""The package layers point one way, inside each package too, and modules stay small enough to read.

    messages  <-  common  <-  agent, coordinator (side by side), client  <-  cli

Inside agent/, coordinator/ and common/, each subpackage may import only the ones SUBLAYERS
names (its ``__init__`` docstring says the same in words), and docs/architecture.md's map lists
exactly the subpackages there are.  Every import of every module is read from its source
(imports inside functions included), so an arrow pointing the wrong way fails here, not in review.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("messages", "common", "agent", "coordinator", "client", "cli")
# What each layer may import from revenant (itself always).
ALLOWED = {
    "messages": set(),
    "common": {"messages"},
    "agent": {"messages", "common"},
    "coordinator": {"messages", "common"},
    # What programs build on: the bus and the messages, never a service's insides.
    "client": {"messages", "common"},
    "cli": {"messages", "common", "agent", "coordinator", "client"},
}
# Inside a package, what each subpackage may import of its package's other subpackages ("": the
# modules at the package's top, which may import every subpackage unless named here).
SUBLAYERS = {
    "agent": {
        "storage": set(), "processes": set(),
        "pipeline": {"storage", "processes"},
        "network": {"pipeline", "processes"},
        "gpus": {"pipeline", "storage", "processes"},
        "lazyrestore": {"pipeline", "storage", "processes"},
        "files": {"network", "pipeline", "storage", "processes"},
        "checkpointing": {"files", "lazyrestore", "gpus", "network", "pipeline", "storage", "processes"},
        "running": {"checkpointing", "lazyrestore", "files", "gpus", "network", "pipeline", "storage", "processes"},
        "node": {"running", "checkpointing", "lazyrestore", "files", "gpus", "network", "pipeline", "storage",
                 "processes"},
    },
    "coordinator": {"table": set(), "nodes": set(), "recovery": {"table", "nodes"}},
    "common": {"": set(), "settings": {""}, "serving": {""}, "messaging": {"settings", ""}},
}
# Benchmarks aside, no module in these packages grows past about a few screens, and no folder
# holds more modules than a reader can name.
SMALL = ("agent", "common", "coordinator", "client", "cli")
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 85
MAX_FOLDER_MODULES = 13


def modules(package: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def dotted(path: pathlib.Path) -> str:
    """``agent/storage/epochs.py`` as ``revenant.agent.storage.epochs``."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("revenant", *parts))


def subpackages(package: str) -> list[str]:
    return sorted(d.name for d in (ROOT / package).iterdir() if (d / "__init__.py").is_file())


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
    wrong = [f"{path.relative_to(ROOT)}:{line} imports revenant.{layer}"
             for path in modules(package)
             for line, layer in revenant_imports(path)
             if layer != package and layer not in ALLOWED[package]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_layer_test_sees_a_wrong_arrow(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from revenant.agent.node.health import evaluate\n")
    assert revenant_imports(bad) == [(2, "agent")]


@pytest.mark.parametrize("package", SMALL)
def test_modules_and_functions_stay_small(package):
    long = []
    for path in modules(package):
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() is {length} lines")
    assert not long, "split these:\n" + "\n".join(long)


def module_imports(path: pathlib.Path) -> set[str]:
    """The revenant modules a module imports (``revenant.agent.storage.epochs``), anywhere in it: inside
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
    graph = {dotted(m): module_imports(m) for p in PACKAGES for m in modules(p) if m.name != "__init__.py"}
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


def subpackage_of(package: str, module: str) -> str | None:
    """The subpackage of ``package`` that dotted ``module`` is in ("" for its top-level modules);
    None if it is not in ``package``."""
    parts = module.split(".")
    if parts[:2] != ["revenant", package] or len(parts) < 3:
        return None
    return parts[2] if (ROOT / package / parts[2] / "__init__.py").is_file() else ""


@pytest.mark.parametrize("package", sorted(SUBLAYERS))
def test_subpackages_import_only_the_ones_below_them(package):
    rules = SUBLAYERS[package]
    assert set(subpackages(package)) == set(rules) - {""}, "SUBLAYERS and the folders differ"
    wrong = []
    for path in modules(package):
        here = subpackage_of(package, dotted(path))
        if here not in rules:
            continue  # a top-level module not named in the rules: it may import every subpackage
        for target in module_imports(path):
            there = subpackage_of(package, target)
            if there is not None and there != here and there not in rules[here]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "imports against the subpackages' layering:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", SMALL)
def test_no_folder_holds_more_modules_than_a_reader_can_name(package):
    crowded = []
    for folder in [ROOT / package, *(ROOT / package / s for s in subpackages(package))]:
        count = sum(1 for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        if count > MAX_FOLDER_MODULES:
            crowded.append(f"{folder.relative_to(ROOT)}: {count} modules")
    assert not crowded, "group these:\n" + "\n".join(crowded)


def test_the_architecture_map_lists_exactly_the_subpackages():
    text = (ROOT / "docs" / "architecture.md").read_text()
    mapped = set(re.findall(r"^\| `((?:agent|coordinator|common)/[a-z_]+)/` \|", text, re.M))
    folders = {f"{p}/{s}" for p in SUBLAYERS for s in subpackages(p)}
    assert mapped == folders, f"in the map, not a folder: {sorted(mapped - folders)}; a folder, not in the map: " \
                              f"{sorted(folders - mapped)}"
    for folder in folders:  # each says what it owns and what it may import
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or ""
        assert "import" in doc, f"{folder}/__init__.py: its docstring says nothing of what it may import"
