"""The wheels in bench/wheels, for the GPU image that lacks them: each wheel whose distribution is
not installed is unpacked into one temporary folder that goes on sys.path (and on the PYTHONPATH
of children such as the gpu tests' pytest). A wheel is a zip of its import tree, so unpacking is
installing; llguidance's is an abi3 build for x86-64 Linux. Importing this module does it."""

from __future__ import annotations

import atexit
import re
import shutil
import sys
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

WHEELS = Path(__file__).resolve().parent / "wheels"


def distribution(wheel: Path) -> str:
    """The distribution a wheel file holds, normalized (`pytest-9.2.0-py3-none-any.whl`: pytest)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def missing_wheels(wheels: Path = WHEELS) -> list[Path]:
    """The carried wheels whose distribution is not installed here."""
    out = []
    for wheel in sorted(wheels.glob("*.whl")):
        try:
            version(distribution(wheel))
        except PackageNotFoundError:
            out.append(wheel)
    return out


def unpack(wheels: list[Path], dest: Path) -> Path:
    """`wheels` unpacked into `dest` (a folder to put on sys.path)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(dest)
    return dest


def put_on_path() -> Path | None:
    """Unpack the carried wheels this machine lacks and put them on sys.path; the folder (removed
    at exit), or None when nothing is missing."""
    wheels = missing_wheels()
    if not wheels:
        return None
    folder = Path(tempfile.mkdtemp(prefix="loramux-wheels-"))
    atexit.register(shutil.rmtree, folder, True)
    sys.path.append(str(unpack(wheels, folder)))
    print(f"carried wheels put on the path: {', '.join(w.name for w in wheels)}", flush=True)
    return folder


UNPACKED = put_on_path()
"""Where the wheels this machine lacks were unpacked when this module was imported, or None."""
