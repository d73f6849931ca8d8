"""The field owns the dynamics: only ``model.py`` and ``field.py`` touch the model's and the field's private members,
only ``field.py`` counts evaluations, and ``et_ode.analysis`` reads nothing private of another module.

The source is scanned with ``ast``: an attribute access ``obj._name`` on an object other than ``self`` / ``cls`` is
private use, unless ``_name`` is a dunder or is defined in the scanning module itself (a class reaching into
another instance of its own kind). The scanner is checked on planted snippets first, so a scanner that finds
nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
OWNERS = ("et_ode/energy/model.py", "et_ode/dynamics/field.py")
# the classes the model is made of: their private members are the model's
MODEL_PARTS = ("et_ode/energy/model.py", "et_ode/dynamics/field.py", "et_ode/energy/energies.py", "et_ode/energy/neurons.py")
SCANNED = ("et_ode", "analysis", "benchmarks", "examples")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, methods, classes, and attributes it assigns on ``self``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
            names.add(node.attr)
    return names


def private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, "obj._name")`` for every private attribute used on something other than ``self`` / ``cls``, except
    names the module defines itself."""
    tree = ast.parse(source)
    own = defined_names(tree)
    uses = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)) or node.attr in own:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        uses.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return uses


def counter_writes(source: str) -> list[int]:
    """Lines that assign to ``<anything>.evaluations.count`` (``=`` or ``+=``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == "count"
                and isinstance(target.value, ast.Attribute)
                and target.value.attr == "evaluations"
            ):
                lines.append(node.lineno)
    return lines


def model_private_names() -> set[str]:
    """The private members of the model's and the field's classes, less those ``nn.Module`` itself defines
    (``_apply`` is torch's)."""
    names = set()
    for path in MODEL_PARTS:
        names |= defined_names(ast.parse((ROOT / path).read_text()))
    return {name for name in names if not hasattr(nn.Module, name)}


def sources(*folders: str) -> list[Path]:
    files = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    assert files, f"nothing to scan under {folders}"
    return files


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_scanner_finds_planted_uses():
    planted = (
        "def helper(field, model, g):\n"
        "    a = model._dE_dg(g, None)\n"
        "    b = field.model._energy_g(g, field.mask)\n"
        "    field.evaluations.count += 1\n"
        "    return self._ok, a.__class__, b\n"
    )
    assert private_uses(planted) == [(2, "model._dE_dg"), (3, "field.model._energy_g")]
    assert counter_writes(planted) == [4]
    assert counter_writes("field.evaluations.count = 0\n") == [1]
    # a module's own private names are its own business
    assert private_uses("def _step(x):\n    return x\nclass A:\n    def _f(self, other):\n        return other._f()\n") == []
    assert {"_energy_g", "_dE_dg", "_checked", "_centered"} <= model_private_names()
    assert "_apply" not in model_private_names()


@pytest.mark.parametrize("path", sources(*SCANNED), ids=_relative)
def test_no_module_but_model_and_field_uses_their_private_members(path):
    if _relative(path) in OWNERS:
        return
    forbidden = model_private_names()
    source = path.read_text()
    uses = [f"line {line}: {use}" for line, use in private_uses(source) if use.rsplit(".", 1)[1] in forbidden]
    assert not uses, f"{_relative(path)} uses private members of the model or the field (use ETField's public API): {uses}"
    writes = counter_writes(source)
    assert not writes, (
        f"{_relative(path)} writes the field's evaluation counter at lines {writes}: use field.count_evaluations(n)"
    )


@pytest.mark.parametrize("path", sources("analysis"), ids=_relative)
def test_analysis_reads_nothing_private(path):
    uses = [f"line {line}: {use}" for line, use in private_uses(path.read_text())]
    assert not uses, f"{_relative(path)} uses private members of other modules or objects: {uses}"
