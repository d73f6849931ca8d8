"""Convergence traces against independent computations; decay fits on known curves."""

from __future__ import annotations

import math

import pytest
import torch
from torchdiffeq import odeint

from et_ode import ETField, GraphMask, solve
from et_ode.analysis.convergence import analyze_convergence, convergence_traces, first_time_below, fit_decay
from et_ode.dynamics.manifold import riemannian_hessian
from tests.conftest import random_model


def test_fit_decay_recovers_exponential_and_power_law():
    t = torch.linspace(0.0, 20.0, 81, dtype=torch.float64)
    exponential, power = fit_decay(t, 3.0 * torch.exp(-0.7 * t))
    assert exponential.rate == pytest.approx(0.7, rel=1e-10) and exponential.prefactor == pytest.approx(3.0, rel=1e-9)
    assert exponential.rms_log_residual < 1e-10 < power.rms_log_residual
    exponential, power = fit_decay(t, 2.0 * t.clamp_min(1e-300) ** -1.5)
    assert power.rate == pytest.approx(1.5, rel=1e-10) and power.prefactor == pytest.approx(2.0, rel=1e-9)
    assert power.rms_log_residual < 1e-10 < exponential.rms_log_residual
    assert power.points == 72  # the last half of the span in log time: t >= sqrt(0.25 * 20) = 2.236
    short, _ = fit_decay(t[:2], t[:2] + 1)
    assert math.isnan(short.rate)


def test_fit_window_is_in_log_time_on_a_log_spaced_grid():
    """26 log-spaced times: a linear-time window keeps 2 points and both fits are NaN; the log-time one 13."""
    t = torch.logspace(-1, 4, 26, dtype=torch.float64)
    exponential, power = fit_decay(t, 0.8 * t**-0.56)
    assert power.points == 13 and exponential.points == 13
    assert power.rate == pytest.approx(0.56, rel=1e-10) and power.prefactor == pytest.approx(0.8, rel=1e-9)
    assert math.isfinite(exponential.rate) and exponential.rms_log_residual > 1e-3
    # a short tail still keeps min_points points
    _, narrow = fit_decay(t, 0.8 * t**-0.56, tail=0.01)
    assert narrow.points == 5 and narrow.rate == pytest.approx(0.56, rel=1e-10)


def test_first_time_below():
    t = torch.arange(6, dtype=torch.float64)
    assert first_time_below(t, torch.tensor([5.0, 0.5, 2.0, 0.5, 0.1, 0.01]), 1.0) == 3.0
    assert first_time_below(t, torch.tensor([5.0, 0.5, 2.0, 0.5, 0.1, 3.0]), 1.0) is None
    assert first_time_below(t, torch.full((6,), 0.1), 1.0) == 0.0


def test_traces_match_independent_computations():
    model = random_model(seed=7)
    field = ETField(model, tau=0.5)
    x0 = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))  # batch (2, 3)
    solution = solve(field, x0, torch.linspace(0, 8, 17))
    traces = convergence_traces(solution)
    assert traces.energy.shape == (17, 6)
    xs = solution.xs.reshape(17, 6, 5, 8)
    assert torch.allclose(traces.energy, solution.energies.reshape(17, 6))
    assert torch.allclose(traces.rms_dg_dt, torch.stack([field.rms_dg_dt(x) for x in xs]).detach())
    dx = torch.stack([field(torch.zeros(()), x) for x in xs]).detach()
    assert torch.allclose(traces.rms_dx_dt, dx.square().mean(dim=(-1, -2)).sqrt())
    _, tangent = riemannian_hessian(field, model.neuron(xs[-1]).detach())
    assert torch.allclose(traces.rms_tangent_gradient[-1], tangent.square().mean(dim=(-1, -2)).sqrt())
    mean_shift = xs.mean(-1) - xs[0].mean(-1)
    assert torch.allclose(traces.ones_drift, mean_shift.square().mean(-1).sqrt())
    scale = xs.std(dim=-1, unbiased=False)
    assert torch.allclose(traces.radial_drift, (scale - scale[0]).mean(-1), atol=1e-6)


def test_traces_use_the_mask_the_solution_was_solved_with():
    model = random_model(seed=9)
    generator = torch.Generator().manual_seed(9)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=generator)
    mask = torch.rand(2, 5, 5, generator=generator) < 0.6
    mask |= torch.eye(5, dtype=torch.bool)
    solution = solve(ETField(model, tau=0.7).with_mask(mask), x0, torch.linspace(0, 3, 7))
    traces = convergence_traces(solution)
    for b in range(2):  # the model's public energy with sample b's own mask, one sample at a time
        expected = torch.stack([model.energy(x[b], mask[b]) for x in solution.xs]).detach()
        assert torch.allclose(traces.energy[:, b], expected, rtol=1e-12, atol=1e-12)
    # RMS dg/dt against central differences of g = LayerNorm(x) along the flow (torchdiffeq, forward and backward)
    h = 1e-5
    for k in (1, 4):
        t = float(solution.ts[k])
        ends = [
            odeint(solution.field, solution.xs[k], torch.tensor([t, t + step], dtype=torch.float64), rtol=1e-12, atol=1e-14)[
                -1
            ]
            for step in (h, -h)
        ]
        dg_dt = (model.neuron(ends[0]) - model.neuron(ends[1])).detach() / (2 * h)
        assert torch.allclose(traces.rms_dg_dt[k], dg_dt.square().mean(dim=(-1, -2)).sqrt(), rtol=1e-6)
    unmasked = convergence_traces(solve(ETField(model, tau=0.7), x0, torch.linspace(0, 3, 7)))
    assert not torch.allclose(unmasked.energy, traces.energy)


def test_analysis_of_a_random_model():
    model = random_model(seed=8)
    field = ETField(model)
    x0 = torch.randn(3, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    solution = solve(field, x0, torch.linspace(0, 40, 81))
    report = analyze_convergence(solution, tol=5e-3, tangent_tol=1e-3)
    for s in report.samples:
        assert s.energy_end < s.energy_start
        assert s.better_fit == "power"  # the motion of g slows like a power of t (sigma grows linearly)
        assert 0.5 < s.power.rate < 3.0
        assert s.ones_drift > 0
        # the token scale grows about linearly in t: twice the time, about twice the drift
        half = float(report.traces.radial_drift[40, s.sample])
        assert 1.6 < s.radial_drift / half < 2.4
        assert s.converged  # all three fall below 5e-3 by t = 29 (13.0, 25.5, 28.5): the checks below must run
        k = int((report.traces.ts == s.t_converged).nonzero())
        assert bool((report.traces.rms_dg_dt[k:, s.sample] < 5e-3).all())
        assert float(report.traces.rms_dg_dt[k - 1, s.sample]) >= 5e-3
    assert "power" in report.table() and report.as_dict()["samples"][0]["power"]["model"] == "power"


def test_bad_inputs():
    model = random_model()
    field = ETField(model)
    x0 = torch.randn(2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="save='all'"):
        analyze_convergence(solve(field, x0, (0.0, 1.0), save="final"))
    with pytest.raises(ValueError, match="tol"):
        analyze_convergence(solve(field, x0, (0.0, 1.0)), tol=0)
    with pytest.raises(ValueError, match="tail"):
        fit_decay(torch.arange(5.0), torch.ones(5), tail=0)


def test_traces_of_a_solution_on_a_graph_mask():
    """A GraphMask (one edge list shared by the batch) reaches the traces as it is: the energies are the model's
    with that mask, and differ from the unmasked ones."""
    model = random_model(seed=4)
    edges = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 2]])
    mask = GraphMask(edges, 5)
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    solution = solve(ETField(model, tau=0.7, mask=mask), x0, torch.linspace(0, 2, 5))
    traces = convergence_traces(solution)
    expected = torch.stack([model.energy(x, mask) for x in solution.xs]).detach()
    assert torch.allclose(traces.energy, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(traces.energy, torch.stack([model.energy(x) for x in solution.xs]).detach())
