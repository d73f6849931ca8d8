"""The library's docstrings and comments state the contract, briefly: module docstrings of at most 25 lines and no
"Public API::" list repeating the signatures; no history (what the code "was", what it does "now", issue numbers);
no speed figures in docstrings (timings, "2x faster", "on this project's machines": those belong to
docs/performance.md and the benchmarks' output).

Every module of ``et_ode/`` and ``analysis/`` is parsed with ``ast`` (docstrings) and ``tokenize`` (comments). The
patterns are narrow enough that the mathematics passes: tolerances such as "1e-8 in float64", a "95% interval",
"the faster modes", names like ``measured_exponent``; the tests at the end check both sides on sample sentences.
Every callable of ``et_ode.__all__`` names each of its arguments in an ``Args:`` section (``Attributes:`` for a
dataclass).
"""

from __future__ import annotations

import ast
import enum
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(path for folder in ("et_ode", "analysis") for path in (REPO / folder).rglob("*.py"))
MAX_MODULE_DOCSTRING_LINES = 25

HISTORY = re.compile(
    r"\b(?:was|were|now|no longer|used to|previously|formerly|anymore|originally|as before|than before|this landing)\b"
    r"|\b(?:issues?|PR|pull request)\s*#?\d+|(?<!\S)#\d+\b",
    re.IGNORECASE,
)
CODE = re.compile(r"``.*?``|`[^`]*`")  # inline code and Sphinx roles: names, not prose
_NUMBER = r"\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?"
SPEED = re.compile(
    "|".join(
        [
            rf"\b{_NUMBER}\s*[x×]\s+(?:faster|slower|quicker|as fast|the speed)\b",  # 2x faster, 2.4-4.4x slower
            r"\b(?:twice|thrice|\w+ times) (?:as fast|as slow|faster|slower|quicker)\b",
            r"\bspeed-?ups?\b",
            rf"\b{_NUMBER}\s*(?-i:ns|µs|us|ms|s|secs?|seconds?|mins?|minutes?|h|hours?)\b(?![-/])",  # timings
            rf"\b{_NUMBER}\s*%[^.;:]{{0,30}}\b(?:faster|slower|quicker|speed)\b",  # 8% slower
            rf"\b{_NUMBER}\s*% of (?:a|the|each) (?:\S+ )?(?:step|solve|run|epoch)\b",  # 2% of a 28x28 step
            r"\bthis project's (?:\w+ )?(?:machines?|hardware|CPUs?|hosts?)\b",
            r"\bon (?:a |an |one |the same )?(?:\d+-core|two-core|idle|busy|loaded|shared) (?:\S+ )?(?:machine|host)s?\b",
            r"\bon (?:one|two|\d+) cores\b",
            r"\bmeasured (?:time|timings?|speed|at \d|on (?:this|these|an? (?:\S+ )?(?:machine|host|CPU|core)s?|AVX))",
        ]
    ),
    re.IGNORECASE,
)


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, text)`` for every line of every module, class and function docstring of ``tree``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                start = node.body[0].lineno
                lines.extend((start + offset, line) for offset, line in enumerate(text.splitlines()))
    return lines


def comments(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` for every comment of ``source``."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(token.start[0], token.string) for token in tokens if token.type == tokenize.COMMENT]


def _texts(path: Path) -> tuple[ast.Module, list[tuple[int, str]], list[tuple[int, str]]]:
    source = path.read_text()
    return ast.parse(source), docstrings(ast.parse(source)), comments(source)


def _findings(pattern: re.Pattern[str], path: Path, lines: list[tuple[int, str]]) -> list[str]:
    """The matches of ``pattern`` in ``lines``, inline code (``now``, a parameter's name) left out."""
    return [
        f"{_relative(path)}:{number}: {match[0]!r} in {text.strip()!r}"
        for number, text in lines
        for match in pattern.finditer(CODE.sub(" ", text))
    ]


def test_the_library_has_its_modules() -> None:
    assert len(MODULES) >= 60


@pytest.mark.parametrize("path", MODULES, ids=_relative)
def test_module_docstring_is_a_short_paragraph(path: Path) -> None:
    tree = ast.parse(path.read_text())
    text = ast.get_docstring(tree, clean=False)
    assert text is not None, f"{_relative(path)} has no module docstring"
    assert len(text.splitlines()) <= MAX_MODULE_DOCSTRING_LINES, (
        f"{_relative(path)}: a module docstring of {len(text.splitlines())} lines (at most "
        f"{MAX_MODULE_DOCSTRING_LINES}; the reasoning belongs to the docs pages)"
    )
    assert "Public API" not in text, f"{_relative(path)}: a 'Public API' list repeats the signatures"


@pytest.mark.parametrize("path", MODULES, ids=_relative)
def test_no_history_in_docstrings_or_comments(path: Path) -> None:
    _, documented, commented = _texts(path)
    findings = _findings(HISTORY, path, documented + commented)
    assert not findings, "history words (state what the code does, not what it did):\n" + "\n".join(findings)


@pytest.mark.parametrize("path", MODULES, ids=_relative)
def test_no_speed_figures_in_docstrings(path: Path) -> None:
    _, documented, _ = _texts(path)
    findings = _findings(SPEED, path, documented)
    assert not findings, "speed figures (they belong to docs/performance.md):\n" + "\n".join(findings)


@pytest.mark.parametrize(
    "sentence",
    [
        "The packed weight was slower on AVX2.",
        "Checkpoints were pickles; they no longer are.",
        "The field now caches its weights.",
        "It used to take the dtype (issue 13).",
        "as in #42",
        "previously a closure of fit",
    ],
)
def test_history_pattern_finds_history(sentence: str) -> None:
    assert HISTORY.search(sentence), sentence


@pytest.mark.parametrize(
    "sentence",
    [
        "runs about twice as fast in float32",
        "2-2.8x slower than oneDNN",
        "up to 2x faster beyond 32 tokens",
        "exp is 2.4-4.4x slower than exp2",
        "building the stage times costs 20 us a solve",
        "the demo takes 2 min 4 s",
        "one epoch in 1.5 seconds",
        "a training step measured 8% slower",
        "2% of a 28x28 step",
        "on this project's machines",
        "on a 2-core machine under load",
        "on two cores",
        "a 3.1x speed-up",
        "Measured time: about a minute",
    ],
)
def test_speed_pattern_finds_figures(sentence: str) -> None:
    assert SPEED.search(sentence), sentence


@pytest.mark.parametrize(
    "sentence",
    [
        "to 1e-8 in float64",
        "Wilson 95% interval of the frequency",
        "predicted_exponent and measured_exponent",
        "the faster modes have died out",
        "the iteration stops earlier when the space is exhausted",
        "applied twice, a 13-point stencil",
        "``2 S`` searches in all",
        "a long stay near a saddle can postpone it to ``t ~ 1e20``",
        "RMS |dg/dt| < 1e-3 in every sample, at most to t = 1000",
        "the checks made before a file is read",
        "a header claiming 1 GiB is refused",
        "the energy before and after per sample",
        "halved when Newton fails; 10% of the patches stay visible",
        "the rate measured on a solve",
        "``W = [WK; WQ; xi]`` of shape ``(R, D)``, ``R = 2 H Y + K``",
        "``(setting, saved, now)`` for every setting that differs",
    ],
)
def test_the_patterns_pass_the_mathematics(sentence: str) -> None:
    prose = CODE.sub(" ", sentence)
    assert not HISTORY.search(prose), sentence
    assert not SPEED.search(prose), sentence


def _parameters(obj: object) -> list[str]:
    """The named parameters of a function, or of a class's constructor (``*args``, ``**kwargs`` left out)."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [name for name, p in signature.parameters.items() if name not in ("self", "cls") and p.kind not in variadic]


def _documented(doc: str) -> set[str]:
    """The names an ``Args:`` (or, for a dataclass, ``Attributes:``) section describes: ``name:``, ``name (type):``
    or ``a, b:`` at the start of an entry."""
    section = re.search(r"^(?:Args|Attributes):\n((?:[ \t]+\S.*\n?|\n)*)", doc, re.MULTILINE)
    if section is None:
        return set()
    entries = re.findall(r"^ {4}(\w+(?:, \w+)*)(?: \([^)]*\))?:", section[1], re.MULTILINE)
    return {name for entry in entries for name in entry.split(", ")}


def _public_callables() -> list[str]:
    import et_ode

    return [
        name
        for name in et_ode.__all__
        if callable(obj := getattr(et_ode, name))
        and not (inspect.isclass(obj) and issubclass(obj, enum.Enum))
        and _parameters(obj)
    ]


@pytest.mark.parametrize("name", _public_callables())
def test_public_callables_document_every_argument(name: str) -> None:
    import et_ode

    obj = getattr(et_ode, name)
    missing = [p for p in _parameters(obj) if p not in _documented(inspect.getdoc(obj) or "")]
    assert not missing, f"et_ode.{name}: no Args: entry for {missing}"


def test_the_args_check_reads_grouped_entries() -> None:
    doc = "Summary.\n\nArgs:\n    x0: states ``(N, D)``.\n    rtol, atol: tolerances,\n        positive.\n\nReturns:\n    y."
    assert _documented(doc) == {"x0", "rtol", "atol"}
    assert _documented("Summary.\n\nReturns:\n    x0: not an argument.") == set()
