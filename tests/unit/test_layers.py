"""The package's layers point only down (issue 30): a module of one subpackage imports only from
its own subpackage and those below it, with every import counted (at the top, inside a function,
under TYPE_CHECKING). The order is written here and in README's Layout section."""

from __future__ import annotations

import ast
from pathlib import Path

import oomguard

# Bottom first. The top-level modules (__main__) sit above them all.
LAYERS = ("model", "detect", "config", "sense", "cgroup", "policy", "store", "act", "gpu",
          "terminal", "lifecycle", "observe", "respond", "control", "daemon", "cli")
PACKAGE = Path(oomguard.__file__).parent


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of an oomguard module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "oomguard":
                found += [(node.lineno, f"oomguard.{alias.name}") for alias in node.names]
            elif node.module.startswith("oomguard."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names
                      if alias.name.startswith("oomguard.")]
    return found


def upward_imports(package: Path, layers: tuple[str, ...]) -> list[str]:
    rank = {name: index for index, name in enumerate(layers)}
    problems = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if len(parts) == 1:
            continue  # oomguard/__init__.py, __main__.py: above every layer
        own = parts[0]
        if own not in rank:
            problems.append(f"{path.relative_to(package.parent)}: {own}/ is in no layer")
            continue
        for line, module in imported(ast.parse(path.read_text(), str(path))):
            target = module.split(".")[1]
            if target in rank and rank[target] > rank[own]:
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {module} "
                                f"({target}/ is above {own}/)")
    return problems


def test_every_subpackage_has_a_layer() -> None:
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS)


def test_no_import_points_up_a_layer() -> None:
    assert upward_imports(PACKAGE, LAYERS) == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "oomguard"
    for layer in ("model", "store"):
        (package / layer).mkdir(parents=True)
        (package / layer / "__init__.py").write_text("")
    (package / "store" / "ok.py").write_text("from oomguard.model.x import y\n")
    (package / "model" / "bad.py").write_text(
        "def f():\n    from oomguard.store.ok import y\n    return y\n")
    assert upward_imports(package, ("model", "store")) == [
        "oomguard/model/bad.py:2 imports oomguard.store.ok (store/ is above model/)"]
