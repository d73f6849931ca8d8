"""The module map of docs/architecture.md, enforced on the code: no import cycle, the layering, the leaves, the
library free of argparse, and the graph in the document equal to the one the code has.

Imports are read with ``ast`` (tools/import_graph.py): top-level, late (inside a function) and type-only imports
all count. A rule the code does not meet yet is marked ``xfail(strict=True)`` for that one module, with the reason:
when the code is fixed the mark must go (a strict xfail that passes fails the run).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph
_spec.loader.exec_module(import_graph)

FILES = import_graph.module_files()
IMPORTS = import_graph.imports()
EDGES = import_graph.graph(IMPORTS)

# What today's code still does against the target layout of issue 13 (one entry per module and rule). The lead
# removes an entry when the work that fixes it lands; a fixed module whose entry stays fails the run (strict).
# (Empty since the solve/adjoints/attractor/gradients cycle went: Implicit polishes in et_ode.equilibrium.certify.)
NOT_YET: dict[tuple[str, str], str] = {}


def _cases(rule: str, names: list[str]) -> list:
    """``names`` as parameters, each marked strict-xfail where NOT_YET lists it under ``rule``."""
    cases = []
    for name in names:
        reason = NOT_YET.get((rule, name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        cases.append(pytest.param(name, marks=marks, id=name))
    return cases


def _where(source: str, target: str) -> str:
    lines = [f"{item.line} ({item.kind})" for item in IMPORTS if item.source == source and item.target == target]
    return f"{FILES[source].relative_to(REPO)} imports {target} at line {', '.join(lines)}"


def test_the_reader_finds_every_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph is only as good as its reader: a late, a type-only, a relative and a package import are all found,
    and a cycle made of late imports is a cycle."""
    (tmp_path / "et_ode" / "sub").mkdir(parents=True)
    (tmp_path / "analysis").mkdir()
    files = {
        "et_ode/__init__.py": "from .a import f\n",
        "et_ode/a.py": "import os\n\ndef f():\n    from .b import g\n    return g\n",
        "et_ode/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from et_ode.sub import c\n"
        "def g():\n    from . import a\n",
        "et_ode/sub/__init__.py": "",
        "et_ode/sub/c.py": "from .. import b\nfrom ..a import f\n",
        "analysis/__init__.py": "from .plots import p\n",
        "analysis/plots.py": "from et_ode import f\nimport et_ode.sub.c\n",
    }
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    found = {(i.source, i.target, i.kind) for i in import_graph.imports(tmp_path)}
    assert found == {
        ("et_ode", "et_ode.a", "top"),
        ("et_ode.a", "et_ode.b", "late"),
        ("et_ode.b", "et_ode.sub.c", "types"),
        ("et_ode.b", "et_ode.a", "late"),
        ("et_ode.sub.c", "et_ode.b", "top"),
        ("et_ode.sub.c", "et_ode.a", "top"),
        ("et_ode.analysis", "et_ode.analysis.plots", "top"),
        ("et_ode.analysis.plots", "et_ode", "top"),
        ("et_ode.analysis.plots", "et_ode.sub.c", "top"),
    }
    cycles = import_graph.cycles(import_graph.graph(import_graph.imports(tmp_path)))
    assert cycles == [["et_ode.a", "et_ode.b", "et_ode.sub.c"]]


def test_every_source_file_is_read() -> None:
    """Both folders are scanned, and the package's own imports are seen (a reader that found nothing would pass
    every rule below)."""
    assert {"et_ode", "et_ode.dynamics.field", "et_ode.analysis", "et_ode.analysis.convergence"} <= set(FILES)
    assert "et_ode.energy.model" in EDGES["et_ode.dynamics.field"]
    assert len(IMPORTS) > 100


@pytest.mark.parametrize("module", _cases("cycle", sorted(FILES)))
def test_module_is_on_no_import_cycle(module: str) -> None:
    """No module imports itself through others, counting late and type-only imports: the graph is a DAG."""
    for cycle in import_graph.cycles(EDGES):
        assert module not in cycle, f"{module} is on the import cycle {' <-> '.join(cycle)}"


@pytest.mark.parametrize("module", _cases("placed", sorted(FILES)))
def test_module_has_a_layer(module: str) -> None:
    """Every module has its place in the map (tools/import_graph.py's LAYERS, docs/architecture.md): a new module
    is placed there when it is written."""
    assert import_graph.layer_of(module) is not None, f"{module} belongs to no layer of tools/import_graph.py LAYERS"


@pytest.mark.parametrize("module", _cases("layer", sorted(m for m in FILES if import_graph.layer_of(m))))
def test_module_imports_nothing_downstream(module: str) -> None:
    """Data flows energy -> dynamics -> integrators -> equilibrium -> solving -> models -> training -> analysis ->
    tasks -> cli: a module imports its own package or lower ones, so the energy knows nothing of solvers, the
    library nothing of tasks or the CLI, and analysis nothing of tasks."""
    rank = import_graph.layer_rank(module)
    unplaced = len(import_graph.LAYERS)  # a module without a layer counts as above them all
    upward = [
        target
        for target in sorted(EDGES.get(module, ()))
        if (import_graph.layer_rank(target) if import_graph.layer_of(target) else unplaced) > rank
    ]
    assert not upward, f"{module} ({import_graph.layer_of(module)}) imports downstream: " + "; ".join(
        f"{_where(module, t)} ({import_graph.layer_of(t)})" for t in upward
    )


LEAVES = [module for module in FILES if import_graph.layer_of(module) == "backend"]


@pytest.mark.parametrize("module", _cases("leaf", sorted(LEAVES)))
def test_leaf_imports_no_module_of_ours(module: str) -> None:
    """A module of the lowest package (backend) is importable from anywhere: it imports nothing of ours."""
    assert not EDGES.get(module), "; ".join(_where(module, target) for target in sorted(EDGES[module]))


def _imports_argparse(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        (isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == "argparse")
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("module", _cases("argparse", sorted(m for m in FILES if import_graph.layer_of(m) != "cli")))
def test_only_the_cli_parses_arguments(module: str) -> None:
    """The CLI only parses arguments and calls functions usable from Python; nothing else knows argparse."""
    assert not _imports_argparse(FILES[module]), f"{FILES[module].relative_to(REPO)} imports argparse"


@pytest.mark.parametrize(
    "module", _cases("target", ["et_ode.energy.masks", "et_ode.tasks.image", "et_ode.tasks.graph", "et_ode.cli"])
)
def test_target_module_exists(module: str) -> None:
    """The layout of issue 13: the masks leaf, the tasks' own home, the CLI as a package."""
    assert module in FILES
    if module == "et_ode.cli":
        assert FILES[module].name == "__init__.py", "et_ode.cli is a package (et_ode/cli/), one module per command"


def _defined_in(name: str) -> list[str]:
    return [
        module
        for module, path in FILES.items()
        if any(
            isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
            for node in ast.parse(path.read_text()).body
        )
    ]


@pytest.mark.parametrize("name", _cases("leaf-home", ["resolve_device", "seed_everything"]))
def test_device_and_seed_helpers_live_in_a_leaf(name: str) -> None:
    """``distributed`` and ``train`` both need the device and seed helpers; in a leaf, neither imports the other."""
    homes = _defined_in(name)
    assert len(homes) == 1 and import_graph.layer_of(homes[0]) == "backend", f"{name} is defined in {homes}"


def test_the_tree_shows_the_layers() -> None:
    """The package's top level holds its subpackages and the public API, not a flat list of modules."""
    top = sorted(path.name for path in (REPO / "et_ode").glob("*.py"))
    assert len(top) <= 6, f"et_ode/ holds {len(top)} modules directly: {top}"
    assert {import_graph.layer_of(module) for module in FILES} == set(import_graph.LAYERS)


def test_architecture_doc_shows_the_current_import_graph() -> None:
    """docs/architecture.md draws the graph the code has (refresh: python tools/import_graph.py --write-docs)."""
    document = import_graph.DOC.read_text()
    assert document == import_graph.docs_with_graph(document, IMPORTS), (
        "the import graph in docs/architecture.md is stale: run `python tools/import_graph.py --write-docs`"
    )


def test_architecture_doc_names_every_layer() -> None:
    """The map in the document and the rules of the test are the same map."""
    document = import_graph.DOC.read_text()
    for layer, patterns in import_graph.LAYERS.items():
        assert f"**{layer}**" in document, f"docs/architecture.md does not describe the layer {layer}"
        for pattern in patterns:
            assert f"`{pattern}`" in document, f"docs/architecture.md does not place {pattern}"
