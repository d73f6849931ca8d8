"""The analysis integrations have step budgets: a horizon or state too large for the tolerances ends in a named
:class:`et_ode.SolveError` instead of a hang or torchdiffeq's AssertionError."""

from __future__ import annotations

import time

import pytest
import torch

from et_ode import EnergyTransformer, ETField, SolveError, solve
from et_ode.analysis import check_lyapunov
from et_ode.analysis.exponents import Benettin, lyapunov_exponent
from et_ode.analysis.lyapunov import bounded_odeint


def _field() -> ETField:
    torch.manual_seed(0)
    return ETField(EnergyTransformer(dim=8, heads=2, head_dim=4, memories=8).double())


def test_bounded_odeint_names_what_ran_out_of_steps():
    field = _field()
    x0 = torch.randn(2, 3, 8, dtype=torch.float64)
    grid = torch.tensor([0.0, 1e6], dtype=torch.float64)
    started = time.perf_counter()
    with pytest.raises(SolveError, match=r"^probe: the dopri5 integration from t=0 to t=1e\+06 stopped.*20 steps"):
        bounded_odeint(field, x0, grid, method="dopri5", rtol=1e-12, atol=1e-14, what="probe", max_steps=20)
    assert time.perf_counter() - started < 10
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        bounded_odeint(field, x0, grid, method="dopri5", rtol=1e-6, atol=1e-8, what="probe", max_steps=0)


def test_check_lyapunov_over_an_enormous_interval_is_a_named_error():
    field = _field()
    solution = solve(field, torch.randn(1, 3, 8, dtype=torch.float64), (0.0, 1.0), save="all")
    solution.ts[-1] = 1e300  # the saved end as a solve to t = 1e300 records it: one interval to re-evaluate densely
    with pytest.raises(SolveError, match=r"check_lyapunov's dense re-evaluation"):
        check_lyapunov(solution, max_steps=50)


def test_lyapunov_exponent_restart_spans_have_a_budget():
    field = _field()
    x0 = torch.randn(1, 3, 8, dtype=torch.float64) * 1e30
    with pytest.raises(SolveError, match=r"lyapunov_exponent \(restart\)|solve failed"):
        lyapunov_exponent(field, x0, benettin=Benettin(t1=1e9, renormalizations=1), restart=True, max_steps=20)
