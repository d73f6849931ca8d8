"""``solve(..., progress=True)``: a progress bar over the time span that changes nothing in the result."""

from __future__ import annotations

import pytest
import torch

from et_ode import EnergyTransformer, ETField, Fixed, solve


def _field() -> ETField:
    torch.manual_seed(0)
    return ETField(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=16, dtype=torch.float64))


@pytest.mark.parametrize("solver", ["dopri5", Fixed("rk4", step_size=0.1)])
def test_the_bar_shows_the_time_and_the_result_is_unchanged(solver: object, capsys: pytest.CaptureFixture[str]) -> None:
    field = _field()
    x0 = torch.randn(2, 4, 8, dtype=torch.float64)
    quiet = solve(field, x0, (0.0, 3.0), solver=solver, save="final")  # type: ignore[arg-type]
    assert "solve (" not in capsys.readouterr().err
    shown = solve(field, x0, (0.0, 3.0), solver=solver, save="final", progress=True)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "solve (" in err and "/3 |" in err  # the span's end as the bar's total
    assert torch.equal(quiet.x, shown.x) and quiet.stats.nfe_forward == shown.stats.nfe_forward


def test_progress_must_be_a_bool() -> None:
    field = _field()
    with pytest.raises(TypeError, match="progress"):
        solve(field, torch.randn(1, 4, 8, dtype=torch.float64), (0.0, 1.0), progress="yes")  # type: ignore[arg-type]


def test_the_command_lines_default_shows_the_bar_of_a_slow_solve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show_solve_progress(True)`` (what ``et-ode`` does) turns the bar on for solves left at ``progress=None``,
    drawn once a solve has run ``SLOW_SOLVE_SECONDS`` (zero here, so that this quick solve counts as slow)."""
    from et_ode.backend import runtime

    field = _field()
    x0 = torch.randn(1, 4, 8, dtype=torch.float64)
    solve(field, x0, (0.0, 1.0), save="final")
    assert "solve (" not in capsys.readouterr().err  # off by default in the library
    monkeypatch.setattr(runtime, "SLOW_SOLVE_SECONDS", 0.0)
    monkeypatch.setitem(runtime._SOLVE_PROGRESS, "default", False)
    runtime.show_solve_progress(True)
    solve(field, x0, (0.0, 1.0), save="final")
    assert "solve (dopri5)" in capsys.readouterr().err
    solve(field, x0, (0.0, 1.0), save="final", progress=False)  # an explicit False wins
    assert "solve (" not in capsys.readouterr().err
