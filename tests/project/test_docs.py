"""The documentation site (`make docs`) builds with every warning an error, says what it should, and every
```python block on every page runs.

A docstring that documents a parameter the signature does not have (renamed, removed, misspelt), a page that
names a module that does not exist, a broken link or anchor between pages, or a page left out of the navigation
fails the strict build. The blocks of one page run in order in one namespace, in a scratch folder, and what they
print is checked against their ``print(...)  # figures`` comments (tests/docs_blocks.py).
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

from tests.docs_blocks import python_blocks, run_block

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(page for page in DOCS.rglob("*.md") if python_blocks(page))
HAS_MKDOCS = all(importlib.util.find_spec(name) is not None for name in ("mkdocs", "mkdocstrings_handlers"))
needs_mkdocs = pytest.mark.skipif(not HAS_MKDOCS, reason="mkdocs and mkdocstrings[python] are not installed")


@pytest.fixture(scope="module")
def docstrings():
    if not HAS_MKDOCS:
        pytest.skip("mkdocs and mkdocstrings[python] are not installed")
    spec = importlib.util.spec_from_file_location("griffe_docstrings", REPO / "tools" / "griffe_docstrings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(DOCS)) for page in PAGES])
def test_every_python_block_of_the_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs"}
    for index, block in enumerate(python_blocks(page)):
        run_block(block, f"{page.relative_to(DOCS)} block {index}", namespace)


def test_the_guides_have_their_blocks() -> None:
    """The pages that teach by example keep their examples (and this test finds them, nested folders included)."""
    names = {str(page.relative_to(DOCS)) for page in PAGES}
    for page in (
        "index.md",
        "getting-started.md",
        "math.md",
        "guides/solving.md",
        "guides/gradients.md",
        "guides/attractors.md",
        "guides/own-energy.md",
        "guides/analysis.md",
        "guides/tasks.md",
        "guides/cli.md",
        "guides/distributed.md",
        "reliability.md",
    ):
        assert page in names, page
    assert sum(len(python_blocks(page)) for page in PAGES) >= 20


def test_a_failing_block_fails_its_page(tmp_path: Path) -> None:
    namespace: dict = {}
    run_block("x = 41\nprint(x + 1)  # 42\n", "probe block 0", namespace)
    with pytest.raises(AssertionError, match="the page says"):
        run_block("print(x)  # 42\n", "probe block 1", namespace)  # the namespace is shared: x is 41
    with pytest.raises(NameError):
        run_block("print(undefined)\n", "probe block 2", namespace)


def test_no_page_points_outside_the_repository() -> None:
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        for word in ("SPEC.md", "../shared", "shared/data", "this landing", "the issue"):
            assert word not in text, (page, word)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=config.parent,
        timeout=300,
    )


def _text(page: Path) -> str:
    """The visible text of an HTML page, whitespace collapsed."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.read_text())))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAS_MKDOCS:
        pytest.skip("mkdocs and mkdocstrings[python] are not installed")
    site = tmp_path_factory.mktemp("site")
    result = _build(REPO / "mkdocs.yml", site)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return site


def test_api_reference_builds_strictly(site: Path) -> None:
    for page in [
        "index.html",
        "architecture/index.html",
        "getting-started/index.html",
        "guides/solving/index.html",
        "guides/attractors/index.html",
        "math/index.html",
        "performance/index.html",
        "api/et_ode/index.html",
        "api/energy/index.html",
        "api/kernels/index.html",
        "api/dynamics/index.html",
        "api/integrators/index.html",
        "api/linalg/index.html",
        "api/equilibrium/index.html",
        "api/solving/index.html",
        "api/models/index.html",
        "api/training/index.html",
        "api/analysis/index.html",
        "api/tasks/index.html",
        "api/cli/index.html",
    ]:
        assert (site / page).is_file(), page


def test_reference_documents_each_parameter_with_its_type(site: Path) -> None:
    """The docstrings reach the pages: each parameter of a grouped entry (``dtype, device: ...``) on its own, with
    its type from the signature; Sphinx roles as plain code."""
    model = _text(site / "api" / "energy" / "index.html")
    assert "EnergyTransformer" in model and "Multi-head energy attention" in model
    assert re.search(r"dtype \( dtype \| None , default: None \) – of the parameters, as in PyTorch's modules", model)
    assert re.search(r"device \( device \| str \| None , default: None \) – of the parameters, as in PyTorch's", model)
    assert ":class:" not in model
    field = _text(site / "api" / "dynamics" / "index.html")
    assert "ETField" in field and "dE_dt" in field
    analysis = _text(site / "api" / "analysis" / "index.html")
    assert "analyze_convergence" in analysis and "check_lyapunov" in analysis


@needs_mkdocs
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


def test_grouped_entries_split_into_one_per_name(docstrings) -> None:
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


def test_sphinx_roles_become_inline_code(docstrings) -> None:
    assert docstrings.plain_roles("see :func:`solve` and :class:`~et_ode.ETField`, not `x`") == (
        "see `solve` and `et_ode.ETField`, not `x`"
    )


def test_every_public_module_has_a_reference_entry() -> None:
    """Each public module (no part of its name private, packages aside) is on one of the API pages, so a module
    added to the library is added to the reference."""
    directives = set(
        re.findall(r"^::: ([\w.]+)", "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md")), flags=re.M)
    )
    modules = []
    for folder in ("et_ode", "analysis"):
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if path.name != "__init__.py" and not any(part.startswith("_") for part in parts):
                modules.append(".".join(parts))
    assert len(modules) >= 40
    missing = sorted(set(modules) - directives)
    assert not missing, f"modules on no page of docs/api/ (add a `::: module` line): {missing}"


def _command_lines(text: str) -> list[str]:
    """The ``et-ode ...`` commands in the fenced shell blocks of a page, continuation lines joined, comments cut."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip() or "shell", []
            else:
                if language in ("shell", "bash"):
                    blocks.append("\n".join(lines))
                language = None
        elif language is not None:
            lines.append(line)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            if "-m et_ode.cli " in line:  # under torchrun
                line = "et-ode " + line.split("-m et_ode.cli ", 1)[1]
            if line.startswith("et-ode ") and "..." not in line:
                commands.append(line)
    return commands


def test_every_et_ode_command_on_the_pages_parses() -> None:
    """A command a page shows uses options that exist (argparse exits on an unknown one)."""
    from et_ode.cli import build_parser

    parser = build_parser()
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    commands = [(page, line) for page in pages for line in _command_lines(page.read_text())]
    assert len(commands) >= 10
    for page, line in commands:
        try:
            parser.parse_args(line.split()[1:])
        except SystemExit:
            pytest.fail(f"{page.relative_to(REPO)}: `{line}` does not parse")


def test_the_top_level_page_names_every_export_where_it_is_defined() -> None:
    """docs/api/et_ode.md lists each name of ``et_ode.__all__`` once, beside the module that holds it."""
    import importlib

    import et_ode

    rows = re.findall(r"^\| (`[^|]+`) \| \[`([\w.]+)`\]\(\w+\.md\) \|", (DOCS / "api" / "et_ode.md").read_text(), flags=re.M)
    listed = {name: module for names, module in rows for name in re.findall(r"`(\w+)`", names)}
    assert sorted(listed) == sorted(et_ode.__all__)
    for name, module in listed.items():
        assert getattr(importlib.import_module(module), name) is getattr(et_ode, name), (name, module)
