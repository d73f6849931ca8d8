"""et_ode.analysis on energies the library did not design (a Euclidean neuron's chart): stability, critical points,
continuation, Lyapunov exponents and the report, against closed forms and dense Hessians; and the tools that need
the LayerNorm neuron's spheres refusing with the neuron's name."""

from __future__ import annotations

import json
import math

import pytest
import torch

import et_ode
from et_ode.analysis import (
    Benettin,
    FixedScaleField,
    analyze,
    check_lyapunov,
    continue_branch,
    find_fixed_point,
    fixed_point_stability,
    lyapunov_exponent,
    measured_exponent,
    newton_critical_point,
    plot_attention,
    predicted_exponent,
    riemannian_hessian_matrix,
    saddle_from_minimum,
)
from et_ode.analysis.chart import EuclideanChart, SphereChart, chart_for
from tests.energy.test_user_energies import DenseMemory, docs_model
from tests.equilibrium.test_user_attractors import hopfield_network


def two_patterns(beta: float) -> et_ode.EnergyModel:
    """Patterns at -1 and 1 on a line: ``E(x) = x^2 / 2 - log cosh(beta x) / beta + const``, so ``E'(x) = x -
    tanh(beta x)`` and ``E''(0) = 1 - beta``: a pitchfork at beta = 1."""
    patterns = torch.tensor([[-1.0], [1.0]], dtype=torch.float64)
    return et_ode.EnergyModel(et_ode.IdentityNeuron(1), {"memory": DenseMemory(patterns, beta)})


def test_the_chart_follows_the_neuron():
    model, x0 = docs_model()
    chart = chart_for(et_ode.ETField(model))
    assert isinstance(chart, EuclideanChart) and chart.dimension(4) == 8 and chart.rate() == 1.0
    frame = chart.frame(x0[0])
    torch.testing.assert_close(frame.flatten(1) @ frame.flatten(1).T, torch.eye(8, dtype=torch.float64))
    assert isinstance(chart_for(et_ode.ETField(et_ode.EnergyTransformer(4, 1, 2, 3))), SphereChart)
    with pytest.raises(TypeError, match="field must be an et_ode.ETField, got EnergyModel"):
        chart_for(model)


def test_stability_of_a_user_energy_against_its_dense_hessian_and_jacobian():
    model = hopfield_network()
    field = et_ode.ETField(model, tau=2.0)
    x0 = torch.randn(3, 1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fixed = find_fixed_point(field, et_ode.solve(field, x0, (0.0, 80.0)).x.detach(), tol=1e-11)
    assert fixed.converged
    dense = fixed_point_stability(field, fixed.x, method="dense")
    lanczos = fixed_point_stability(field, fixed.x, method="lanczos")
    layer = model.get_submodule("0")
    for b, (exact, krylov) in enumerate(zip(dense.samples, lanczos.samples, strict=True)):
        hessian = torch.autograd.functional.hessian(lambda x: model.energy(x), fixed.x[b]).reshape(6, 6)
        values = torch.linalg.eigvalsh(hessian)
        assert exact.smallest == pytest.approx(float(values[0]), rel=1e-9)
        assert krylov.smallest == pytest.approx(float(values[0]), rel=1e-6)
        # the flow tau dx/dt = -x + W g + b: Jacobian (-I + W diag(g (1 - g))) / tau
        g = torch.sigmoid(fixed.x[b, 0])
        jacobian = (-torch.eye(6, dtype=torch.float64) + layer.W.detach() * (g * (1 - g))[None, :]) / 2.0
        rates = torch.linalg.eigvals(jacobian).real
        assert exact.rate_slowest == pytest.approx(float(rates.max()), rel=1e-9)
        assert exact.rate_fastest == pytest.approx(float(rates.min()), rel=1e-9)
        assert krylov.rate_slowest == pytest.approx(float(rates.max()), rel=1e-6)
        assert krylov.rate_fastest == pytest.approx(float(rates.min()), rel=1e-6)
    assert "Hessian of E(g(x)) in x (dimension 6 per sample)" in dense.table()


def test_the_lyapunov_exponent_at_a_user_attractor_is_the_slowest_rate():
    model = hopfield_network()
    field = et_ode.ETField(model)
    x0 = torch.randn(1, 1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = et_ode.find_attractor(field, x0)
    exponent = lyapunov_exponent(
        field,
        found.x,
        benettin=Benettin(t1=80.0, renormalizations=40, d0=1e-6, solver=et_ode.Adaptive("dopri5", rtol=1e-12, atol=1e-14)),
        restart=True,
    )
    g = torch.sigmoid(found.x[0, 0])
    jacobian = -torch.eye(6, dtype=torch.float64) + model.get_submodule("0").W.detach() * (g * (1 - g))[None, :]
    slowest = float(torch.linalg.eigvals(jacobian).real.max())
    assert float(exponent.late[0]) == pytest.approx(slowest, rel=2e-3)  # the next rate is 0.08 faster


def test_critical_points_of_any_index_in_the_euclidean_chart():
    model = two_patterns(beta=3.0)
    field = et_ode.ETField(model)
    saddle = newton_critical_point(field, torch.tensor([[0.05]], dtype=torch.float64))
    assert saddle.converged and saddle.index == 1 and float(saddle.x) == pytest.approx(0.0, abs=1e-12)
    assert float(saddle.eigenvalues[0]) == pytest.approx(1 - 3.0, rel=1e-10)  # E''(0) = 1 - beta
    minimum = newton_critical_point(field, torch.tensor([[0.8]], dtype=torch.float64))
    x_star = float(minimum.x)
    assert minimum.index == 0 and x_star == pytest.approx(math.tanh(3.0 * x_star), abs=1e-10)  # E'(x) = x - tanh(3 x)
    found = saddle_from_minimum(field, minimum.x, direction=-1)
    assert found.index == 1 and float(found.x) == pytest.approx(0.0, abs=1e-10)


def test_continuation_finds_the_pitchfork_at_beta_one():
    branch = continue_branch(two_patterns, torch.tensor([[0.0]], dtype=torch.float64), 0.5, mu_end=1.5)
    points = [b for b in branch.bifurcations if b.kind == "branch point"]
    assert len(points) == 1 and points[0].mu == pytest.approx(1.0, abs=1e-8)
    assert (points[0].index_before, points[0].index_after) == (0, 1)


def test_the_lyapunov_check_reads_the_neuron_and_the_energy_scale():
    model, x0 = docs_model()
    solution = et_ode.solve(
        et_ode.ETField(model),
        x0,
        torch.linspace(0.0, 30.0, 31, dtype=torch.float64),
        solver=et_ode.Adaptive(rtol=1e-10, atol=1e-12),
    )
    report = check_lyapunov(solution)
    assert report.all_passed and report.m_psd and report.m_min_eigenvalue == 1.0
    assert report.gamma is None and "neuron IdentityNeuron" in report.table()


def test_the_report_on_a_user_energy(tmp_path):
    model = et_ode.EnergyModel(
        et_ode.IdentityNeuron(2),
        {"memory": DenseMemory(torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 1.5]], dtype=torch.float64), beta=2.0)},
    )
    x0 = torch.tensor([[[0.9, 0.2]], [[-0.3, 1.2]]], dtype=torch.float64)
    folder = analyze(model, x0, out=tmp_path, progress=False, landscape=True, basin_radii=[0.1, 0.3])
    data = json.loads((folder / "report.json").read_text())
    assert data["config"]["neuron"] == "IdentityNeuron" and data["config"]["interactions"] == {"memory": "DenseMemory"}
    assert data["gamma"] is None and all(data["lyapunov"]["passed"])
    stability = data["stability"]["samples"]
    assert [s["kind"] for s in stability] == ["stable attractor"] * 2
    for b, sample in enumerate(stability):
        x = et_ode.find_attractor(et_ode.ETField(model), x0[b : b + 1]).x[0]
        hessian = torch.autograd.functional.hessian(lambda y: model.energy(y), x).reshape(2, 2)
        assert sample["smallest"] == pytest.approx(float(torch.linalg.eigvalsh(hessian)[0]), rel=1e-6)
    markdown = (folder / "report.md").read_text()
    assert markdown.startswith("# Energy dynamics report") and "IdentityNeuron" in markdown
    assert "attention" not in data["pictures"] and "energy_slice" in data["pictures"]
    notes = " ".join(data["landscape"]["notes"])
    assert "the asymptotic exponent needs the LayerNorm neuron's sphere geometry" in notes
    assert data["landscape"]["continuation"] is not None


def test_the_tools_of_the_spheres_refuse_a_euclidean_neuron_by_name():
    model, x0 = docs_model()
    field = et_ode.ETField(model)
    solution = et_ode.solve(field, x0, torch.linspace(0.0, 1.0, 3, dtype=torch.float64))
    for call in (
        lambda: predicted_exponent(field, x0[0]),
        lambda: measured_exponent(field, x0[0]),
        lambda: FixedScaleField(field),
        lambda: riemannian_hessian_matrix(field, x0),
    ):
        with pytest.raises(ValueError, match="needs the LayerNorm neuron's sphere geometry.*IdentityNeuron"):
            call()
    with pytest.raises(
        ValueError, match=r"plot_attention draws an EnergyAttention interaction named 'attention'.*\['memory'\]"
    ):
        plot_attention(solution)
