"""Lyapunov exponents in intrinsic time and the QR spectrum against -(gamma / tau) times the Riemannian Hessian's
eigenvalues (torch.func matrices); the Hessian along a trajectory against the dense stability analysis."""

from __future__ import annotations

import pytest
import torch

from et_ode import Adaptive, ETField, SolveError, solve
from et_ode.analysis.exponents import Benettin, lyapunov_exponent
from et_ode.analysis.spectra import hessian_along, lyapunov_spectrum
from et_ode.analysis.sphere import FixedScaleField
from et_ode.analysis.stability import find_fixed_point, fixed_point_stability
from et_ode.dynamics.manifold import to_limit_spheres
from tests.analysis.test_stability import U3, closed_form, one_token_model
from tests.conftest import random_model

TAU = 0.7


@pytest.fixture(scope="module")
def minimum():
    model = random_model(dim=5, heads=2, head_dim=3, memories=8, hopfield="softmax", seed=1)
    field = ETField(model, tau=TAU)
    x = torch.randn(1, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = find_fixed_point(field, x, tol=1e-11, max_iter=5000)
    report = fixed_point_stability(field, found.x, method="dense")  # torch.func Hessian of E, independent
    assert report.samples[0].kind == "stable attractor"
    eigenvalues = torch.tensor(report.samples[0].eigenvalues, dtype=torch.float64)
    return field, found.x, eigenvalues


@pytest.mark.parametrize("scale", [1.0, None])
def test_fixed_scale_field_keeps_sigma_and_moves_g_at_the_intrinsic_rate(minimum, scale):
    """At token scale 1 and on the limit spheres alike: ``dx/dt`` is tangent (no mean, no radial part), and
    ``dg/dt = M dx/dt = -(gamma / tau) T dE/dg``, the ET field's at ``sigma = 1`` (up to ``O(eps)``)."""
    field, _, _ = minimum
    neuron = field.model.neuron
    x = to_limit_spheres(torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3)), neuron.eps)
    if scale is not None:
        x = x * (scale / x.square().mean(dim=-1, keepdim=True).sqrt())
    fixed = FixedScaleField(field)
    gamma = float(neuron.gamma.detach())
    with torch.no_grad():
        velocity = fixed(0.0, x)
        size = float(velocity.abs().max())
        assert float((velocity * x).sum(-1).abs().max()) < 1e-12 * size * float(x.abs().max())
        assert float(velocity.sum(-1).abs().max()) < 1e-12 * size
        expected = -gamma / TAU * field.tangent_gradient(x)
        assert torch.allclose(neuron.hessian_vector(x, velocity), expected, atol=1e-9)
        if scale is not None:  # sigma = sqrt(1 + eps): the ET field's own dg/dt, up to its radial part O(eps)
            assert torch.allclose(neuron.hessian_vector(x, velocity), field.dg_dt(x), atol=1e-4)


def test_restarted_lyapunov_exponent_is_unbiased_at_a_minimum(minimum):
    """-(gamma / tau) lambda_min; restarting only per span was biased toward zero (-0.658 for -1.146)."""
    field, x_star, eigenvalues = minimum
    gamma = float(field.model.neuron.gamma.detach())
    expected = -gamma * float(eigenvalues[0]) / TAU
    result = lyapunov_exponent(field, x_star, benettin=Benettin(t1=60.0, renormalizations=20), restart=True)
    assert float(result.late[0]) == pytest.approx(expected, rel=1e-4)
    assert float(result.exponent[0]) == pytest.approx(expected, rel=0.2)  # carries the start's transient, ~1/T
    assert float(result.exponent[0]) < float(result.late[0])


def test_qr_spectrum_at_a_minimum_is_minus_gamma_over_tau_times_the_hessian(minimum):
    field, x_star, eigenvalues = minimum
    gamma = float(field.model.neuron.gamma.detach())
    expected = -gamma * eigenvalues / TAU  # descending
    spectrum = lyapunov_spectrum(field, x_star[0], benettin=Benettin(t1=40.0, renormalizations=80))
    assert spectrum.late.tolist() == pytest.approx(expected.tolist(), rel=2e-3)
    top = lyapunov_spectrum(field, x_star[0], count=2, benettin=Benettin(t1=40.0, renormalizations=80))
    assert top.late.tolist() == pytest.approx(expected[:2].tolist(), rel=2e-3)


def test_qr_spectrum_at_a_saddle_has_one_positive_exponent():
    model = one_token_model()
    field = ETField(model)
    x = U3[None] * 3.0
    spectrum = lyapunov_spectrum(field, x, benettin=Benettin(t1=40.0, renormalizations=20, d0=1e-8))
    r = float(model.neuron(to_limit_spheres(x, model.neuron.eps)).detach().norm())
    gamma = float(model.neuron.gamma.detach())
    expected = sorted((-gamma * v for v in closed_form("u3", r)), reverse=True)
    assert spectrum.late.tolist() == pytest.approx(expected, rel=1e-3)
    assert float(spectrum.late[0]) > 0 > float(spectrum.late[1])


def test_the_lyapunov_functions_check_their_settings():
    field = ETField(one_token_model())
    x = U3[None] * 3.0
    with pytest.raises(TypeError, match="benettin must be a Benettin"):
        lyapunov_exponent(field, x, benettin=dict(t1=1.0))
    with pytest.raises(TypeError, match="benettin must be a Benettin"):
        lyapunov_spectrum(field, x, benettin=None)
    with pytest.raises(ValueError, match="at least 2"):
        lyapunov_spectrum(field, x, benettin=Benettin(renormalizations=1))
    with pytest.raises(ValueError, match="max_steps"):
        lyapunov_spectrum(field, x, max_steps=0)


@pytest.mark.parametrize("intrinsic", [True, False])
def test_lyapunov_spectrum_spans_keep_their_step_budget(intrinsic):
    field = ETField(one_token_model())
    x = U3[None] * 3.0
    with pytest.raises(SolveError, match="lyapunov_spectrum|steps"):
        lyapunov_spectrum(field, x, benettin=Benettin(t1=40.0, renormalizations=2), intrinsic=intrinsic, max_steps=2)


def test_hessian_along_a_trajectory_matches_the_dense_analysis():
    model = random_model(dim=5, heads=2, head_dim=3, memories=8, hopfield="softmax", seed=1, eps=1e-12)
    field = ETField(model)
    x0 = torch.randn(2, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    solution = solve(field, x0, torch.linspace(0, 30, 16, dtype=torch.float64), solver=Adaptive(rtol=1e-8, atol=1e-10))
    trace = hessian_along(solution, max_times=4)
    assert trace.ts.tolist() == pytest.approx([0.0, 10.0, 20.0, 30.0])
    for k, t in enumerate(trace.ts.tolist()):
        state = solution.xs[int(round(t / 2))]
        report = fixed_point_stability(field, state, method="dense")
        for b, sample in enumerate(report.samples):
            assert float(trace.smallest[k, b]) == pytest.approx(sample.smallest, abs=1e-8)
            assert float(trace.largest[k, b]) == pytest.approx(sample.largest, abs=1e-8)
            assert int(trace.index[k, b]) == sum(v < -1e-8 for v in sample.eigenvalues)
            assert float(trace.rms_tangent_gradient[k, b]) == pytest.approx(sample.rms_tangent_gradient, rel=1e-8)
    first = hessian_along(solution, max_times=4, max_samples=1)
    assert first.smallest.shape == (4, 1) and first.smallest[:, 0].equal(trace.smallest[:, 0])
    with pytest.raises(ValueError, match="max_samples"):
        hessian_along(solution, max_samples=0)
