"""Every ```python block of the README runs as written, and prints what its comments say (tests/docs_blocks.py)."""

from pathlib import Path

import pytest

from tests.docs_blocks import assert_matches, python_blocks, run_block, stated_outputs

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = python_blocks(README)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_block(BLOCKS[index], f"README block {index}", {"__name__": "readme"})


def test_stated_outputs_are_checked():
    """The README states what its examples print (and this file reads those statements)."""
    assert len(BLOCKS) >= 3  # the quick start's three jobs
    assert sum(len(stated_outputs(block)) for block in BLOCKS) >= 2
    with pytest.raises(AssertionError):
        assert_matches("steady_state 255 130.0", "steady_state 255 124.3")
    with pytest.raises(AssertionError):
        assert_matches("reached_end 255 124.3", "steady_state 255 124.3")


def test_the_readme_is_a_front_door():
    """Short, and about the repository itself: no history, nothing outside it."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for word in ("SPEC.md", "../shared", "this landing", "the issue", "issue 1", "issue 2", "issue 3"):
        assert word not in text, word
