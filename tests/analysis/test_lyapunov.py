"""Lyapunov checks: pass on correct solves, flag too-large Euler steps and a negative gamma, with where."""

from __future__ import annotations

import pytest
import torch

from et_ode import ETField, EulerET, Fixed, SolveError, solve
from et_ode.analysis.lyapunov import check_lyapunov, metric_spectrum
from tests.conftest import random_model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_passes_on_adaptive_solves_of_random_models(dtype: torch.dtype):
    model = random_model(dtype=dtype, seed=3)
    field = ETField(model)
    x0 = torch.randn(3, 6, 8, dtype=dtype, generator=torch.Generator().manual_seed(0))
    solution = solve(field, x0, torch.linspace(0, 20, 41))
    report = check_lyapunov(solution)
    assert report.all_passed, report.table()
    assert report.m_psd and report.m_min_eigenvalue > 0
    assert max(report.max_energy_rise) < 0  # the energy fell over every saved interval
    # the trapezoid of the exact dE/dt reproduces the measured energy changes (an independent integration)
    assert max(report.max_mismatch) < 0.05
    assert "energy descends" in report.table() and "VIOLATED" not in report.table()


def test_passes_on_rk4_steps_with_a_mask_and_dense_recheck_agrees():
    model = random_model(seed=1)
    field = ETField(model)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(1)) < 0.7
    field = field.with_mask(mask)
    solution = solve(field, x0, (0.0, 5.0), solver=Fixed("rk4", step_size=0.05), save="steps")
    report = check_lyapunov(solution, match_rtol=1e-3)  # tight: forces dense re-evaluations
    assert report.all_passed, report.table()
    assert report.dense_rechecks > 0 and report.intervals == len(solution.ts) - 1
    assert max(report.max_mismatch) < 1e-3


def test_flags_euler_step_far_too_large():
    model = random_model(seed=3)
    field = ETField(model)
    x0 = torch.randn(3, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    solution = solve(field, x0, solver=EulerET(3.0, 10))
    report = check_lyapunov(solution)
    assert not any(report.passed)
    assert all(not ok for ok in report.follows_rate)
    assert {v.kind for v in report.violations} <= {"dE/dt mismatch", "energy rise"}
    first = [v for v in report.violations if v.sample == 0][0]
    assert first.t0 == pytest.approx(0.0) and first.t1 == pytest.approx(3.0)  # the first step is caught
    assert first.size > first.allowed
    # the same model with a small step follows the ODE
    fine = check_lyapunov(solve(field, x0, solver=EulerET(0.002, 200)))
    assert fine.all_passed, fine.table()


def test_flags_negative_gamma():
    model = random_model(seed=2, positive_gamma=False)
    with torch.no_grad():
        model.neuron.gamma_raw.fill_(-1.0)
    field = ETField(model)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    try:
        solution = solve(field, x0, torch.linspace(0, 2, 11))
    except SolveError as error:  # a diverging solve still leaves a partial trajectory to analyse
        solution = error.solution
    report = check_lyapunov(solution)
    assert not report.m_psd and report.gamma == pytest.approx(-1.0)
    assert not any(report.descends)
    kinds = {v.kind for v in report.violations}
    assert {"M not PSD", "dE/dt > 0", "energy rise"} <= kinds
    rise = [v for v in report.violations if v.kind == "energy rise"][0]
    k = int(torch.isclose(solution.ts, torch.tensor(rise.t0, dtype=solution.ts.dtype)).nonzero()[0])
    assert float(solution.energies[k + 1, rise.sample] - solution.energies[k, rise.sample]) == pytest.approx(rise.size)
    assert "NO" in report.table()


def test_metric_spectrum_matches_dense_M():
    model = random_model(seed=4)
    field = ETField(model)
    x = torch.randn(3, 8, dtype=torch.float64) * torch.tensor([[0.1], [1.0], [5.0]], dtype=torch.float64)
    eye = torch.eye(8, dtype=torch.float64)
    dense = torch.stack([model.neuron.hessian_vector(x[a].expand(8, 8), eye) for a in range(3)]).detach()
    values = torch.linalg.eigvalsh((dense + dense.transpose(1, 2)) / 2)
    psd, smallest = metric_spectrum(field, x)
    nonzero = values[values.abs() > 1e-14]
    assert smallest == pytest.approx(float(nonzero.min()), rel=1e-6)
    assert psd


def test_bad_inputs():
    model = random_model()
    field = ETField(model)
    x0 = torch.randn(2, 4, 8, dtype=torch.float64)
    final = solve(field, x0, (0.0, 1.0), save="final")
    with pytest.raises(ValueError, match="save='all'"):
        check_lyapunov(final)
    with pytest.raises(TypeError, match="solution"):
        check_lyapunov(x0)
    with pytest.raises(ValueError, match="dense_points"):
        check_lyapunov(solve(field, x0, (0.0, 1.0)), dense_points=3)
