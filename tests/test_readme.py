"""Every ```python block of the README runs as written, and prints what its comments say.

A line ``print(...)  # steady_state 255 124.3`` (a comment with a number) states what it prints: its identifiers
(``steady_state``) must appear and its numbers match in order (to 2%, a margin for solver step counts that may
differ with the CPU's rounding; the README rounds the rest).
"""

import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
WORD = re.compile(r"[A-Za-z_]+")


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
    assert len(got_numbers) >= len(want_numbers), f"printed {printed!r}, the README says {stated!r}"
    for want, got in zip(want_numbers, got_numbers):
        assert got == pytest.approx(want, rel=2e-2, abs=0.051), f"printed {printed!r}, the README says {stated!r}"
    # identifiers such as a status (``steady_state``) must be printed; other words are commentary
    missing = {w for w in WORD.findall(stated) if "_" in w} - set(WORD.findall(printed_clean))
    assert not missing, f"printed {printed!r}, the README says {stated!r}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = f"README block {index}"
    printed: dict[int, list[str]] = {}

    def recording_print(*args, **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_filename == name:
            printed.setdefault(frame.f_lineno, []).append(" ".join(str(a) for a in args))
        print(*args, **kwargs)

    exec(compile(BLOCKS[index], name, "exec"), {"__name__": "readme", "print": recording_print})
    for line, stated in stated_outputs(BLOCKS[index]).items():
        assert line in printed, f"{name}, line {line}: nothing printed, the README says {stated!r}"
        assert_matches(printed[line][-1], stated)


def test_stated_outputs_are_checked():
    """The README states what its examples print (and this file reads those statements)."""
    assert sum(len(stated_outputs(block)) for block in BLOCKS) >= 2
    with pytest.raises(AssertionError):
        assert_matches("steady_state 255 130.0", "steady_state 255 124.3")
    with pytest.raises(AssertionError):
        assert_matches("reached_end 255 124.3", "steady_state 255 124.3")
