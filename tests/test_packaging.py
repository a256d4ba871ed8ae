"""What `pip install loramux` puts into site-packages: one top-level package, `loramux`.

The repository keeps engine/, gateway/, adapters/, kernels/, cache/ and migrations/ at its top
level and links each under loramux/, so the wheel holds `loramux.engine`, `loramux.gateway`, …
and no generic name (`cache`, `engine`) that another distribution could collide with. Every
import in the repository goes through the namespace, so the installed package imports the same
modules the tests do.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "gateway", "adapters", "kernels", "cache", "migrations")
NOT_SOURCE = {".venv", ".git", ".loramux", "test-artifacts", "build", "loramux", "node_modules"}


def source_files() -> list[Path]:
    found: list[Path] = []
    for path in ROOT.iterdir():
        if path.name in NOT_SOURCE or path.name.endswith(".egg-info"):
            continue
        if path.suffix == ".py":
            found.append(path)
        elif path.is_dir() and not path.is_symlink():
            found.extend(p for p in path.rglob("*.py") if not NOT_SOURCE & set(p.parts))
    return found


def test_every_import_of_our_packages_goes_through_the_loramux_namespace() -> None:
    bare: list[str] = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            bare += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                for name in names
                if name.split(".")[0] in PACKAGES
            ]
    assert not bare, "import through loramux.<package>:\n" + "\n".join(bare)


def test_each_package_is_linked_under_the_namespace() -> None:
    for name in PACKAGES:
        link = ROOT / "loramux" / name
        assert link.is_symlink() and link.resolve() == ROOT / name


@pytest.mark.slow
def test_the_wheel_installs_only_the_loramux_package_and_its_console_script(
    tmp_path: Path,
) -> None:
    tree = tmp_path / "src"
    shutil.copytree(
        ROOT,
        tree,
        symlinks=True,
        ignore=shutil.ignore_patterns(*NOT_SOURCE - {"loramux"}, "*.egg-info", "__pycache__"),
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(tree),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("loramux-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"loramux", dist_info}
    for package in PACKAGES:
        assert f"loramux/{package}/__init__.py" in names
    assert "loramux/gateway/app.py" in names
    assert "loramux/migrations/script.py.mako" in names
    assert "loramux = loramux.gateway.cli:main" in entry_points
