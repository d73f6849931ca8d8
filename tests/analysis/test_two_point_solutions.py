"""A solution that saved only its two ends: the Lyapunov check integrates the exact dE/dt along a re-integration
with the solver's own steps (and agrees with the check on a grid); the convergence fit says it cannot fit."""

from __future__ import annotations

import pytest
import torch

from et_ode import ETField, EulerET, solve
from et_ode.analysis import analyze_convergence, check_lyapunov
from tests.conftest import random_model


def _setup():
    model = random_model(seed=3)
    x0 = torch.randn(3, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return ETField(model), x0


def test_a_two_point_solve_over_a_long_span_passes_the_lyapunov_check():
    field, x0 = _setup()
    two = solve(field, x0, t=(0.0, 50.0))
    assert len(two.ts) == 2
    report = check_lyapunov(two)
    assert report.intervals == 1 and report.dense_rechecks == 1  # the trapezoid over [0, 50] disagreed
    assert report.all_passed, report.table()
    assert max(report.max_mismatch) < 1e-3
    grid = check_lyapunov(solve(field, x0, t=torch.linspace(0.0, 50.0, 51, dtype=torch.float64)))
    assert grid.all_passed, grid.table()


def test_the_two_point_check_still_catches_a_scheme_off_the_flow():
    field, x0 = _setup()
    coarse = solve(field, x0, solver=EulerET(3.0, 1))  # one Euler step of 3: two saved times, far off the flow
    assert len(coarse.ts) == 2
    report = check_lyapunov(coarse)
    assert not any(report.follows_rate), report.table()


def test_convergence_of_a_two_point_solve_warns_and_says_why():
    field, x0 = _setup()
    two = solve(field, x0, t=(0.0, 50.0))
    with pytest.warns(RuntimeWarning, match="too few to fit the decay.*linspace"):
        report = analyze_convergence(two)
    assert all(s.better_fit == "n/a" for s in report.samples)
    assert "too few saved times to fit" in report.table() and "nan / nan" not in report.table()


def test_a_final_state_alone_is_refused_with_the_fix():
    field, x0 = _setup()
    with pytest.raises(ValueError, match="save='all' or save='steps'"):
        check_lyapunov(solve(field, x0, (0.0, 5.0), save="final"))
