"""The package reads in small pieces (issue 30): no function or method in oomguard/ is longer
than MAX_FUNCTION_LINES, its docstring and nested functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import oomguard

MAX_FUNCTION_LINES = 60
PACKAGE = Path(oomguard.__file__).parent


def long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == []


def test_the_measure_finds_a_long_function(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (package / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(package, MAX_FUNCTION_LINES) == ["pkg/long.py:5 long (62 lines)"]
