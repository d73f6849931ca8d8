"""What the package ships: its version from one place, its type hints (``py.typed``), ``analysis/`` as
``et_ode.analysis``, and the link through which mypy reads ``analysis/`` under that name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import et_ode

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = (REPO / "pyproject.toml").read_text()


def test_the_version_is_pyprojects() -> None:
    written = re.findall(r'^version = "([^"]+)"$', PYPROJECT, flags=re.M)
    assert written == [et_ode.__version__]
    sources = [path for path in (REPO / "et_ode").rglob("*.py") if re.search(r"__version__\s*=\s*[\"']", path.read_text())]
    assert not sources, f"a version written in the source: {sources}"


def test_mypy_reads_analysis_under_its_installed_name() -> None:
    """tools/mypy/et_ode/analysis is a link to analysis/ (what [tool.mypy] checks), and nothing silences the
    ``et_ode.analysis`` imports."""
    link = REPO / "tools" / "mypy" / "et_ode" / "analysis"
    assert link.is_symlink() and link.resolve() == (REPO / "analysis").resolve()
    assert '"tools/mypy/et_ode/analysis"' in PYPROJECT and '"analysis"]' not in PYPROJECT
    assert '"et_ode.analysis' not in PYPROJECT.split("[[tool.mypy.overrides]]", 1)[1]


@pytest.mark.slow
def test_the_wheel_holds_the_type_marker_the_c_source_and_the_analysis_package(tmp_path: Path) -> None:
    """A wheel built from a copy of the sources (the checkout is left alone) installs ``et_ode/py.typed``, the native
    loop's C source and ``analysis/`` as ``et_ode/analysis/``."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("et_ode", "analysis"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("et_ode-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "et_ode/py.typed" in names and "et_ode/kernels/native.c" in names
    assert "et_ode/analysis/__init__.py" in names and "et_ode/analysis/report.py" in names
    assert not any(name.startswith("analysis/") for name in names)
