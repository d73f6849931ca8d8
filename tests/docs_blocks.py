"""Running the Python blocks of a Markdown page, and checking what they print against what the page says.

A line ``print(...)  # steady_state 255 124.3`` (a comment with a number) states what it prints: its identifiers
(``steady_state``) must appear and its numbers match in order (to 2%, a margin for solver step counts that may
differ with the CPU's rounding; the pages round the rest).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
WORD = re.compile(r"[A-Za-z_]+")
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    """The fenced ```python blocks of a Markdown page, in order."""
    return BLOCK.findall(page.read_text())


def stated_outputs(block: str) -> dict[int, str]:
    """Line number (1-based) -> the comment of every ``print(...)  # ...`` line that states a figure (has a number)."""
    stated = {}
    for number, line in enumerate(block.splitlines(), start=1):
        code, _, comment = line.partition("  # ")
        if code.lstrip().startswith("print(") and NUMBER.search(comment):
            stated[number] = comment.strip()
    return stated


def assert_matches(printed: str, stated: str) -> None:
    printed_clean = printed.replace("torch.Size", "")
    want_numbers = [float(n) for n in NUMBER.findall(stated)]
    got_numbers = [float(n) for n in NUMBER.findall(printed_clean)]
    assert len(got_numbers) >= len(want_numbers), f"printed {printed!r}, the page says {stated!r}"
    for want, got in zip(want_numbers, got_numbers):
        assert got == pytest.approx(want, rel=2e-2, abs=0.051), f"printed {printed!r}, the page says {stated!r}"
    # identifiers such as a status (``steady_state``) must be printed; other words are commentary
    missing = {w for w in WORD.findall(stated) if "_" in w} - set(WORD.findall(printed_clean))
    assert not missing, f"printed {printed!r}, the page says {stated!r}"


def run_block(source: str, name: str, namespace: dict[str, Any]) -> None:
    """Execute one block in ``namespace`` (shared by the blocks of one page) and check its stated outputs."""
    printed: dict[int, list[str]] = {}

    def recording_print(*args: Any, **kwargs: Any) -> None:
        frame = sys._getframe(1)
        if frame.f_code.co_filename == name:
            printed.setdefault(frame.f_lineno, []).append(" ".join(str(a) for a in args))
        print(*args, **kwargs)

    namespace["print"] = recording_print
    exec(compile(source, name, "exec"), namespace)
    for line, stated in stated_outputs(source).items():
        assert line in printed, f"{name}, line {line}: nothing printed, the page says {stated!r}"
        assert_matches(printed[line][-1], stated)
