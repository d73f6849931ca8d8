"""The import graph of et_ode/ and analysis/ (installed as et_ode.analysis), read from the code with ``ast``.

Every import of one of our modules counts: at the top of a module, inside a function (a late import, which still
ties the two modules together), or under ``if TYPE_CHECKING:`` (a dependency of the types). Nothing is imported or
run, so a module imported by a name computed at run time (``importlib.import_module(name)``, as the CLI wires its
commands) is not seen.

    python tools/import_graph.py             # each module and the modules it imports (L: late, T: types only)
    python tools/import_graph.py --mermaid   # a mermaid flowchart, one box per package
    python tools/import_graph.py --cycles    # the import cycles; exit status 1 if there is one
    python tools/import_graph.py --write-docs  # refresh the graph between the markers of docs/architecture.md

tests/project/test_architecture.py uses the same functions to enforce the layering described in docs/architecture.md.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the installed package name of each source folder (pyproject.toml's package-dir)
PACKAGES = {"et_ode": "et_ode", "analysis": "et_ode.analysis"}
DOC = REPO / "docs" / "architecture.md"

# The packages of et_ode, lowest first: a module may import modules of its own package or of a lower one, never of a
# higher one (docs/architecture.md explains each). "et_ode" is the package's __init__, the public API. "x.*" stands
# for the submodules of x.
PACKAGE_ORDER = (
    "backend", "linalg", "data", "energy", "kernels", "dynamics", "integrators", "equilibrium", "solving", "api",
    "models", "training", "analysis", "tasks", "cli",
)  # fmt: skip
LAYERS: dict[str, tuple[str, ...]] = {
    name: ("et_ode",) if name == "api" else (f"et_ode.{name}", f"et_ode.{name}.*") for name in PACKAGE_ORDER
}
BEGIN, END = "<!-- import graph: begin (tools/import_graph.py --write-docs) -->", "<!-- import graph: end -->"


@dataclass(frozen=True)
class Import:
    """One import of one of our modules: ``source`` imports ``target`` at ``line``.

    ``kind`` is ``"top"`` (runs when ``source`` is imported), ``"late"`` (inside a function) or ``"types"``
    (under ``if TYPE_CHECKING:``, never run).
    """

    source: str
    target: str
    line: int
    kind: str


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the packages, by its installed name: ``{"et_ode.dynamics.field": Path(...), ...}``."""
    modules: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def layer_of(module: str) -> str | None:
    """The name of the layer ``module`` belongs to, or None where :data:`LAYERS` does not place it."""
    for layer, patterns in LAYERS.items():
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return layer
    return None


def layer_rank(module: str) -> int:
    """The position of ``module``'s layer in :data:`LAYERS` (0: the leaves); KeyError if it has none."""
    layer = layer_of(module)
    if layer is None:
        raise KeyError(f"{module} belongs to no layer of LAYERS in tools/import_graph.py")
    return list(LAYERS).index(layer)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module) -> Iterable[tuple[ast.stmt, str]]:
    """Every import statement of ``tree`` with its kind (see :class:`Import`)."""

    def walk(node: ast.AST, kind: str) -> Iterable[tuple[ast.stmt, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "types" if kind == "types" else "late")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), "types")
                for statement in child.orelse:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "top")


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of our modules, or None (not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imports(repo: Path = REPO) -> list[Import]:
    """Every import of one of our modules by one of our modules, in file order."""
    files = module_files(repo)
    known = set(files)
    found: list[Import] = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement, kind in _statements(tree):
            targets: list[str] = []
            if isinstance(statement, ast.Import):
                targets = [alias.name for alias in statement.names]
            else:
                if statement.level:
                    base = module.split(".")
                    base = base if is_package else base[:-1]
                    base = base[: len(base) - (statement.level - 1)]
                    prefix = ".".join(base + ([statement.module] if statement.module else []))
                else:
                    prefix = statement.module or ""
                # `from package import submodule` imports the submodule; `from module import name` the module
                targets = [
                    f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix for alias in statement.names
                ]
            for name in targets:
                target = _resolve(name, known)
                if target is not None and target != module:
                    found.append(Import(module, target, statement.lineno, kind))
    return found


def graph(found: Iterable[Import]) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over all kinds of import."""
    edges: dict[str, set[str]] = {}
    for item in found:
        edges.setdefault(item.source, set()).add(item.target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    nodes = sorted(set(edges) | {t for targets in edges.values() for t in targets})

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return sorted(components)


def mermaid(found: Iterable[Import]) -> str:
    """A mermaid flowchart of the imports between packages, one box per package of :data:`LAYERS` (dotted arrows:
    late or type-only imports only)."""
    kinds: dict[tuple[str, str], set[str]] = {}
    for item in found:
        source, target = layer_of(item.source) or item.source, layer_of(item.target) or item.target
        if source != target:
            kinds.setdefault((source, target), set()).add(item.kind)
    lines = ["```mermaid", "flowchart BT"]
    lines += [f"  {layer}[{LAYERS[layer][0]}]" for layer in LAYERS]
    for (source, target), seen in sorted(kinds.items()):
        lines.append(f"  {source} {'-->' if 'top' in seen else '-.->'} {target}")
    lines.append("```")
    return "\n".join(lines)


def text(found: Iterable[Import]) -> str:
    """Each module and what it imports; late imports marked ``(L)``, type-only ones ``(T)``."""
    by_source: dict[str, dict[str, set[str]]] = {}
    for item in found:
        by_source.setdefault(item.source, {}).setdefault(item.target, set()).add(item.kind)
    mark = {"top": "", "late": " (L)", "types": " (T)"}
    lines = []
    for source in sorted(by_source):
        targets = by_source[source]
        shown = [target + ("" if "top" in kinds else mark[min(kinds)]) for target, kinds in sorted(targets.items())]
        lines.append(f"{source}: {', '.join(shown)}")
    return "\n".join(lines)


def docs_with_graph(document: str, found: Iterable[Import]) -> str:
    """``document`` with the text between the graph markers replaced by the current graph."""
    start, stop = document.index(BEGIN) + len(BEGIN), document.index(END)
    return document[:start] + "\n" + mermaid(found) + "\n" + document[stop:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--mermaid", action="store_true", help="print a mermaid flowchart")
    group.add_argument("--cycles", action="store_true", help="print the import cycles; exit 1 if there is one")
    group.add_argument("--write-docs", action="store_true", help=f"refresh the graph in {DOC.relative_to(REPO)}")
    args = parser.parse_args(argv)
    found = imports()
    if args.cycles:
        components = cycles(graph(found))
        for component in components:
            print(" <-> ".join(component))
        print(f"{len(components)} import cycle(s)")
        return 1 if components else 0
    if args.write_docs:
        DOC.write_text(docs_with_graph(DOC.read_text(), found))
        print(f"wrote the import graph into {DOC}")
        return 0
    print(mermaid(found) if args.mermaid else text(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
