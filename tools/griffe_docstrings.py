"""A Griffe extension for the API reference (`make docs`): our docstrings as the Google-style parser reads them.

Two habits of our docstrings are rewritten before a docstring is parsed (the source is not touched):

- Parameters that go together share one entry (``rtol, atol: tolerances of adaptive methods.``). Griffe would read
  a single parameter named ``"rtol, atol"`` and warn that no such parameter exists, which the strict build turns
  into an error. The entry is repeated once per name, with its whole description, so every name is still checked
  against the signature (a renamed or removed parameter fails the build) and rendered with its type.
- Cross-references in Sphinx's roles (``:class:`ETField```, ``:func:`solve```) would show the role's text in
  Markdown; they become inline code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

SECTIONS = {"Args:", "Arguments:", "Parameters:", "Params:", "Keyword Args:", "Keyword Arguments:", "Other Parameters:"}
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
GROUPED = re.compile(r"^(?P<indent>\s*)(?P<names>\*{0,2}\w+(?:,\s*\*{0,2}\w+)+)(?P<rest>(?:\s*\([^)]*\))?:.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_grouped(text: str) -> str:
    """``text`` with every grouped parameter entry of a parameter section split into one entry per name."""
    lines = text.splitlines()
    out: list[str] = []
    section_indent: int | None = None  # indent of the current parameter section's header, None outside one
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped in SECTIONS:
            section_indent = _indent(line)
            out.append(line)
            i += 1
            continue
        if section_indent is not None and stripped and _indent(line) <= section_indent:
            section_indent = None  # dedent: the section ended
        match = GROUPED.match(line) if section_indent is not None else None
        if match is None:
            out.append(line)
            i += 1
            continue
        entry_indent = _indent(line)
        end = i + 1  # the entry's continuation lines are indented deeper than the entry
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > entry_indent):
            end += 1
        while end > i + 1 and not lines[end - 1].strip():
            end -= 1  # trailing blank lines stay outside the entry
        continuation = lines[i + 1 : end]
        for name in re.split(r",\s*", match["names"]):
            out.append(f"{match['indent']}{name}{match['rest']}")
            out.extend(continuation)
        i = end
    return "\n".join(out)


def plain_roles(text: str) -> str:
    """``text`` with each Sphinx role (``:func:`solve```, ``:class:`~et_ode.ETField```) as inline code."""
    return ROLE.sub(lambda match: f"`{match[1]}`", text)


class Docstrings(griffe.Extension):
    """Rewrites every docstring as the module's doc says, before Griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(split_grouped(obj.docstring.value))
