"""The gateway's shape (STYLE.md): no function over 50 lines, no module over 400, and no
`type: ignore[misc]` (an error's status is set where it is defined, never on an instance); and
no Python module of the project, tests and benchmarks included, over 450 lines.

Read with ast and pathlib from the source tree, so it holds in an sdist as in a git checkout.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = ROOT / "gateway"
PACKAGES = ("adapters", "bench", "cache", "engine", "gateway", "kernels", "migrations", "tests")
MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = 400
MAX_ANY_MODULE_LINES = 450


def _modules() -> list[Path]:
    modules = sorted(GATEWAY.rglob("*.py"))
    assert modules, f"no gateway sources under {GATEWAY}"
    return modules


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, Function]]:
    """Every function in `tree` with its qualified name (Class.method, outer.inner)."""
    found: list[tuple[str, Function]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                found.append((name, node))
            found += _functions(node, f"{name}.")
        else:
            found += _functions(node, prefix)
    return found


def _length(node: Function) -> int:
    """Lines from the first decorator to the last line of the body."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    assert node.end_lineno is not None
    return node.end_lineno - first + 1


def test_no_gateway_function_is_over_50_lines() -> None:
    long: dict[str, int] = {}
    for path in _modules():
        where = path.relative_to(GATEWAY).as_posix()
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            if _length(node) > MAX_FUNCTION_LINES:
                long[f"{where}:{name}"] = _length(node)
    assert long == {}


def test_no_gateway_module_is_over_400_lines() -> None:
    long = {
        path.relative_to(GATEWAY).as_posix(): n
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_gateway_module_silences_a_misc_type_error() -> None:
    marker = "type: ignore" + "[misc]"
    assert [p.relative_to(GATEWAY).as_posix() for p in _modules() if marker in p.read_text()] == []


def test_no_module_of_the_project_is_over_450_lines() -> None:
    modules = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(modules) > 100, f"the project's sources are not under {ROOT}"
    long = {
        path.relative_to(ROOT).as_posix(): n
        for path in modules
        if (n := len(path.read_text().splitlines())) > MAX_ANY_MODULE_LINES
    }
    assert long == {}
