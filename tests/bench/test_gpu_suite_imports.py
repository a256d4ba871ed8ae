"""The GPU suite runs on a machine that has only IMAGE_PACKAGES (and their dependencies)
installed: every third-party package that the suite and its `gpu` tests import is one of those
or travels as a wheel in bench/wheels."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import packages_distributions, requires

from packaging.requirements import Requirement

from bench import gpu_suite, gpu_tests

IMPORTS_OF_THE_SUITE = """
import ast, importlib, json, sys
from pathlib import Path

root = Path.cwd().resolve()
for name in sys.argv[1:]:
    importlib.import_module(name)
ours = [
    Path(m.__file__) for m in list(sys.modules.values())
    if getattr(m, "__file__", None) and Path(m.__file__).is_absolute()
    and Path(m.__file__).suffix == ".py"
    and Path(m.__file__).resolve().is_relative_to(root)
    and not {".venv", "site-packages"} & set(Path(m.__file__).resolve().parts)
]
names = set()
for path in ours:
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
print(json.dumps(sorted(names - set(sys.stdlib_module_names))))
"""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_dependencies(packages: tuple[str, ...]) -> set[str]:
    """`packages` and, transitively, what each requires unconditionally (as installed here)."""
    found: set[str] = set()
    todo = list(packages)
    while todo:
        name = _normalized(todo.pop())
        if name in found:
            continue
        found.add(name)
        for line in requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _modules_the_suite_imports() -> set[str]:
    """Top-level names imported by the repository's modules that the suite and its gpu tests
    load, first-party ones included (a fresh interpreter, as the suite's children are)."""
    root = gpu_tests.ROOT
    tests = [p.relative_to(root).with_suffix("") for p in gpu_tests.gpu_test_files()]
    conftests = {
        t.parent / "conftest" for t in tests if (root / t.parent / "conftest.py").is_file()
    }
    modules = ["bench.gpu_suite", "tests.conftest", *(".".join(m.parts) for m in conftests)]
    modules += [".".join(t.parts) for t in tests]
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS_OF_THE_SUITE, *modules],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(root), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"},
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_everything_the_gpu_suite_imports_is_on_the_image_or_carried_as_a_wheel() -> None:
    installed = _with_dependencies(gpu_tests.IMAGE_PACKAGES)
    carried = {_normalized(w.name.split("-")[0]) for w in gpu_suite.WHEELS.glob("*.whl")}
    first_party = {p.name for p in gpu_tests.ROOT.iterdir() if (p / "__init__.py").is_file()}
    distributions = packages_distributions()
    missing = {
        module: distributions.get(module, ["(not installed here)"])
        for module in _modules_the_suite_imports() - first_party
        if not {_normalized(d) for d in distributions.get(module, [])} & (installed | carried)
    }
    assert missing == {}, f"import these on the GPU image from wheels in {gpu_suite.WHEELS}"
