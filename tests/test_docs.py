"""The API reference (`make docs`) builds from the docstrings with every warning an error, and says what it should.

A docstring that documents a parameter the signature does not have (renamed, removed, misspelt), a page that
names a module that does not exist, or a broken link between pages fails the strict build.
"""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("griffe_docstrings", REPO / "tools" / "griffe_docstrings.py")
assert _spec is not None and _spec.loader is not None
docstrings = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docstrings)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, cwd=config.parent, timeout=300)


def _text(page: Path) -> str:
    """The visible text of an HTML page, whitespace collapsed."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.read_text())))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    result = _build(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return site


def test_api_reference_builds_strictly(site: Path) -> None:
    for page in ["index.html", "architecture/index.html", "api/et_ode/index.html", "api/model/index.html",
                 "api/field/index.html", "api/solve/index.html", "api/attractor/index.html",
                 "api/analysis/index.html", "api/models/index.html", "api/tasks/index.html", "api/runs/index.html",
                 "api/cli/index.html"]:
        assert (site / page).is_file(), page


def test_reference_documents_each_parameter_with_its_type(site: Path) -> None:
    """The docstrings reach the pages: each parameter of a grouped entry (``dtype, device: ...``) on its own, with
    its type from the signature; Sphinx roles as plain code."""
    model = _text(site / "api" / "model" / "index.html")
    assert "EnergyTransformer" in model and "Multi-head energy attention" in model
    assert re.search(r"dtype \( dtype \| None , default: None \) – of the parameters, as in PyTorch's modules", model)
    assert re.search(r"device \( device \| str \| None , default: None \) – of the parameters, as in PyTorch's", model)
    assert ":class:" not in model
    field = _text(site / "api" / "field" / "index.html")
    assert "ETField" in field and "dE_dt" in field
    analysis = _text(site / "api" / "analysis" / "index.html")
    assert "analyze_convergence" in analysis and "check_lyapunov" in analysis


def test_strict_build_fails_on_a_stale_parameter(tmp_path: Path) -> None:
    """The strict build with our settings rejects a docstring naming a parameter the function does not have, also
    inside a grouped entry, and accepts the same module once the docstring is right."""
    source = '''
        """A module."""


        def f(rtol: float, atol: float) -> float:
            """Add.

            Args:
                rtol, {name}: tolerances.
            """
            return rtol + atol
        '''
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# probe\n\n::: probe\n")
    config = (REPO / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*?^(?=\S)", "", config)  # one page: no navigation
    config = config.replace("tools/griffe_docstrings.py", str(REPO / "tools" / "griffe_docstrings.py"))
    (tmp_path / "mkdocs.yml").write_text(config)
    (tmp_path / "probe.py").write_text(textwrap.dedent(source.format(name="atool")))
    stale = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert stale.returncode != 0 and "atool" in stale.stdout + stale.stderr, stale.stdout + stale.stderr
    (tmp_path / "probe.py").write_text(textwrap.dedent(source.format(name="atol")))
    right = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert right.returncode == 0, right.stdout + right.stderr


def test_grouped_entries_split_into_one_per_name() -> None:
    doc = textwrap.dedent("""\
        Solve.

        Args:
            x0: the start.
            rtol, atol: tolerances of
                adaptive methods.

            max_steps, *args (int): the budget.

        Returns:
            a, b: not parameters; left alone.
        """)
    assert docstrings.split_grouped(doc) == textwrap.dedent("""\
        Solve.

        Args:
            x0: the start.
            rtol: tolerances of
                adaptive methods.
            atol: tolerances of
                adaptive methods.

            max_steps (int): the budget.
            *args (int): the budget.

        Returns:
            a, b: not parameters; left alone.
        """).rstrip("\n")


def test_sphinx_roles_become_inline_code() -> None:
    assert docstrings.plain_roles("see :func:`solve` and :class:`~et_ode.ETField`, not `x`") == (
        "see `solve` and `et_ode.ETField`, not `x`")


def test_every_public_module_has_a_reference_entry() -> None:
    """Each public module (no part of its name private, packages aside) is on one of the API pages, so a module
    added to the library is added to the reference."""
    directives = set(re.findall(r"^::: ([\w.]+)", "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md")),
                                flags=re.M))
    modules = []
    for folder in ("et_ode", "analysis"):
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if path.name != "__init__.py" and not any(part.startswith("_") for part in parts):
                modules.append(".".join(parts))
    assert len(modules) >= 40
    missing = sorted(set(modules) - directives)
    assert not missing, f"modules on no page of docs/api/ (add a `::: module` line): {missing}"


def test_docs_example_runs() -> None:
    """The one example of docs/index.md runs as written."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "index.md").read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/index.md", "exec"), {})
