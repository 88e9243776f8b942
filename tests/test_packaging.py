"""The package that installs is the package in this folder: every subpackage is listed for the build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """Witness: the package folders found on disk, against pyproject.toml read with ``tomllib``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {"qkvtrace"}
    for path in (ROOT / "qkvtrace").rglob("*"):
        if path.is_dir() and "__pycache__" not in path.parts and any(path.glob("*.py")) | any(path.glob("*.json")):
            folders.add(".".join(path.relative_to(ROOT).parts))
    folders |= {"qkvtrace.cli"}  # ./cli installs as qkvtrace.cli
    assert folders == listed, f"not listed: {sorted(folders - listed)}; listed but absent: {sorted(listed - folders)}"
    assert config["package-data"]["qkvtrace.schemas"] == ["*.json"]
