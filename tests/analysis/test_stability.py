"""Stability analysis against closed forms: a quadratic energy, and a one-token model with known critical points."""

from __future__ import annotations

import math

import pytest
import torch

from et_ode import EnergyTransformer, ETField
from et_ode.analysis.basin_probes import basin_probe
from et_ode.analysis.eigensolvers import extreme_eigenvalues
from et_ode.analysis.exponents import Benettin, lyapunov_exponent
from et_ode.analysis.sphere import tangent_basis
from et_ode.analysis.stability import (
    find_fixed_point,
    fixed_point_stability,
    g_jacobian,
    operator_stability,
    riemannian_hessian_matrix,
)
from et_ode.dynamics.manifold import radial_direction
from et_ode.linalg.krylov import lanczos
from tests.conftest import random_model


def quadratic(eigenvalues: list[list[float]], seed: int = 0):
    """Hessian operators of ``E(v) = v^T A_b v / 2`` with chosen spectra, one per sample, and the matrices."""
    generator = torch.Generator().manual_seed(seed)
    mats = []
    for values in eigenvalues:
        q, _ = torch.linalg.qr(torch.randn(len(values), len(values), generator=generator, dtype=torch.float64))
        mats.append(q @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ q.T)
    a = torch.stack(mats)
    return (lambda v: (a @ v[..., None])[..., 0]), a


def test_quadratic_classification_and_eigenvalues():
    spectra = [
        [0.3, 1.0, 2.0, 5.0, 7.5, 9.0],
        [-0.7, 0.2, 1.0, 3.0, 4.0, 8.0],
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0],
        [-4.0, -3.0, -2.5, -2.0, -1.0, -0.1],
    ]
    apply, _ = quadratic(spectra)
    like = torch.zeros(4, 6, dtype=torch.float64)
    for method in ("dense", "lanczos"):
        report = operator_stability(apply, like, method=method)
        assert [s.kind for s in report.samples] == ["stable attractor", "saddle", "degenerate", "maximum"]
        for s, values in zip(report.samples, spectra, strict=True):
            assert s.smallest == pytest.approx(values[0], abs=1e-6)
            assert s.largest == pytest.approx(values[-1], abs=1e-6)
    dense = operator_stability(apply, like, method="dense")
    assert dense.samples[1].negative == 1
    assert torch.allclose(
        torch.tensor(dense.samples[1].eigenvalues, dtype=torch.float64),
        torch.tensor(spectra[1], dtype=torch.float64),
        atol=1e-10,
    )


def test_lanczos_and_power_match_dense_on_larger_random_operator():
    values = torch.linspace(-1.0, 3.0, 200, dtype=torch.float64).tolist()
    values[0], values[-1] = -2.0, 6.0  # separated extremes, as power iteration needs
    apply, a = quadratic([values, [v + 3.0 for v in values]], seed=3)
    like = torch.zeros(2, 200, dtype=torch.float64)
    exact = torch.linalg.eigvalsh(a)
    smallest, largest, residual = extreme_eigenvalues(apply, like, method="lanczos", iterations=80)
    assert torch.allclose(smallest, exact[:, 0], atol=1e-6) and torch.allclose(largest, exact[:, -1], atol=1e-6)
    assert bool((residual < 1e-6).all())
    smallest, largest, _ = extreme_eigenvalues(apply, like, method="power", iterations=400)
    assert torch.allclose(smallest, exact[:, 0], atol=1e-6) and torch.allclose(largest, exact[:, -1], atol=1e-6)
    values_all, _ = lanczos(apply, torch.randn(2, 200, dtype=torch.float64), iterations=200)
    assert torch.allclose(values_all, exact, atol=1e-8)


# -- one token: softmax memories +-a u1 and +-c u3 in the centered subspace of R^4 ----------------------------------
U1 = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64) / math.sqrt(2)
U2 = torch.tensor([0.0, 0.0, 1.0, -1.0], dtype=torch.float64) / math.sqrt(2)
U3 = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64) / 2
A, C, BETA = 1.0, 0.5, 1.0


def one_token_model() -> EnergyTransformer:
    zeros = torch.zeros(1, 1, 4, dtype=torch.float64)
    xi = torch.stack([A * U1, -A * U1, C * U3, -C * U3])
    return EnergyTransformer.from_tensors(
        zeros, zeros, xi, 1.0, torch.zeros(4, dtype=torch.float64), hopfield="softmax", beta_hn=BETA, eps=1e-12
    )


def closed_form(point: str, r: float) -> list[float]:
    """Second derivatives of E along the two geodesics through the axis point (the eigenvalues)."""
    if point == "u1":  # minimum: overlaps (a r, -a r, 0, 0)
        z = 2 * math.cosh(BETA * A * r) + 2
        return sorted(
            [
                2 * A * math.sinh(BETA * A * r) / (r * z),  # towards u2
                (2 * A * math.sinh(BETA * A * r) / r - 2 * BETA * C**2) / z,
            ]
        )  # towards u3
    z = 2 + 2 * math.cosh(BETA * C * r)  # u3: overlaps (0, 0, c r, -c r)
    return sorted(
        [
            (2 * C * math.sinh(BETA * C * r) / r - 2 * BETA * A**2) / z,  # towards u1: down
            2 * C * math.sinh(BETA * C * r) / (r * z),
        ]
    )  # towards u2: up


def independent_riemannian_hessian(model: EnergyTransformer, g: torch.Tensor) -> torch.Tensor:
    """Hessian at 0 of ``E(delta + r (s + Q a) / |s + Q a|)`` (a second-order retraction), by autograd."""
    u = g - model.neuron.delta.detach()
    r = float(u.norm())
    s = u / r
    frame = torch.stack([torch.full_like(s, 0.5), s], dim=1)
    q = torch.linalg.svd(torch.eye(4, dtype=torch.float64) - frame @ frame.T).U[:, :2]

    def energy(a: torch.Tensor) -> torch.Tensor:
        p = s + q @ a / r
        return model.energy_g((model.neuron.delta + r * p / p.norm())[None])

    return torch.autograd.functional.hessian(energy, torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize(("point", "kind"), [("u1", "stable attractor"), ("u3", "saddle"), ("u2", "maximum")])
def test_one_token_critical_points(point: str, kind: str):
    model = one_token_model()
    field = ETField(model)
    x = {"u1": U1, "u2": U2, "u3": U3}[point][None, None] * 3.0
    g = model.neuron(x).detach()
    r = float(g.norm())
    reference = torch.linalg.eigvalsh(independent_riemannian_hessian(model, g[0, 0]))
    for method in ("dense", "lanczos", "power"):
        report = fixed_point_stability(field, x, method=method, iterations=200)
        sample = report.samples[0]
        assert sample.kind == kind, (method, sample)
        assert sample.critical and sample.rms_tangent_gradient < 1e-12
        assert sample.smallest == pytest.approx(float(reference[0]), abs=1e-6)
        assert sample.largest == pytest.approx(float(reference[1]), abs=1e-6)
    if point != "u2":
        assert reference.tolist() == pytest.approx(closed_form(point, r), abs=1e-6)
    matrix, _ = riemannian_hessian_matrix(field, x)
    assert torch.allclose(torch.linalg.eigvalsh(matrix[0]), reference, atol=1e-8)


def test_g_jacobian_is_minus_lambda_times_riemannian_hessian():
    """The exact torch.func Jacobian of dg/dt on the tangent space equals -(1/tau) diag(gamma/sigma) Hess_R,
    also away from a critical point (the curvature term comes from the radial drift)."""
    model = random_model(dim=6, heads=2, head_dim=3, memories=8, eps=1e-12)
    field = ETField(model, tau=0.7)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2.0
    jac, basis = g_jacobian(field, x)
    hess, basis2 = riemannian_hessian_matrix(field, x)
    assert torch.equal(basis, basis2)
    sigma = (x - x.mean(-1, keepdim=True)).square().mean(-1).sqrt()  # (B, N)
    rates = (model.neuron.gamma.detach() / sigma).repeat_interleave(4, dim=1)
    expected = -rates[..., None] * hess / field.tau
    assert torch.allclose(jac, expected, atol=1e-8 * float(expected.abs().max()))


def test_tangent_basis_is_orthonormal_and_tangent():
    model = random_model()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    g = model.neuron(x)
    g = g.detach()
    basis = tangent_basis(g, model.neuron.delta.detach())
    assert basis.shape == (2, 5 * 6, 5, 8)
    flat = basis.flatten(2)
    assert torch.allclose(flat @ flat.transpose(1, 2), torch.eye(30, dtype=torch.float64).expand(2, 30, 30), atol=1e-12)
    s, _ = radial_direction(g, model.neuron.delta.detach())
    assert float((basis * s[:, None]).sum(-1).abs().max()) < 1e-12
    assert float(basis.sum(-1).abs().max()) < 1e-12


def test_random_model_fixed_point_lanczos_matches_dense():
    model = random_model(hopfield="softmax", eps=1e-12)  # the exact Jacobian carries O(eps / sigma^2) corrections
    field = ETField(model)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = find_fixed_point(field, x, tol=1e-8, max_iter=2000)
    assert found.converged and bool((found.energy_end <= found.energy_start).all())
    dense = fixed_point_stability(field, found.x, method="dense")
    lanc = fixed_point_stability(field, found.x, method="lanczos", iterations=30)  # 30 = full tangent dimension
    for d, s in zip(dense.samples, lanc.samples, strict=True):
        assert d.critical and d.kind == s.kind
        assert s.smallest == pytest.approx(d.smallest, abs=1e-6) and s.largest == pytest.approx(d.largest, abs=1e-6)
        assert s.rate_slowest == pytest.approx(d.rate_slowest, abs=1e-6)
        assert d.kind == "stable attractor"  # descent ends at a minimum for generic starts


def test_basin_and_lyapunov_exponent_distinguish_minimum_and_saddle():
    model = one_token_model()
    field = ETField(model)
    minimum, saddle = U1[None, None] * 3.0, U3[None, None] * 3.0
    probe_min = basin_probe(field, minimum, radii=[0.01, 0.1], trials=3, t1=10.0)
    probe_saddle = basin_probe(field, saddle, radii=[0.01, 0.1], trials=3, t1=10.0)
    assert probe_min.radius == [0.1] and probe_saddle.radius == [0.0]
    assert float(probe_saddle.returned.max()) == 0.0
    at_min = lyapunov_exponent(field, minimum, benettin=Benettin(t1=4.0, renormalizations=8), restart=True)
    at_saddle = lyapunov_exponent(field, saddle, benettin=Benettin(t1=4.0, renormalizations=8, seed=1), restart=True)
    assert float(at_min.exponent[0]) < 0 < float(at_saddle.exponent[0])
    # with sigma reset to 1 the tangential rate of M is gamma: at the minimum perturbations decay like
    # exp(-gamma lambda_min t); at the saddle they grow at most like exp(gamma |lambda_neg| t)
    gamma = float(model.neuron.gamma.detach())
    r = float(model.neuron(minimum).norm())
    assert float(at_min.exponent[0]) == pytest.approx(-gamma * closed_form("u1", r)[0], rel=0.1)
    assert float(at_saddle.exponent[0]) < -gamma * closed_form("u3", r)[0] * 1.05


def test_bad_inputs_name_the_argument():
    field = ETField(random_model())
    with pytest.raises(ValueError, match="x must have shape"):
        fixed_point_stability(field, torch.zeros(2, 3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="field"):
        fixed_point_stability("model", torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="method"):
        fixed_point_stability(field, torch.randn(1, 3, 8, dtype=torch.float64), method="qr")
    with pytest.raises(ValueError, match="radii"):
        basin_probe(field, torch.randn(1, 3, 8, dtype=torch.float64), radii=[0.1, 0.01])


def test_masked_field_lanczos_matches_dense_per_sample_masks():
    model = random_model(dim=6, heads=2, head_dim=3, memories=8, hopfield="softmax")
    generator = torch.Generator().manual_seed(4)
    mask = torch.rand(2, 4, 4, generator=generator) < 0.6  # a different graph per sample
    field = ETField(model, mask=mask)
    x = torch.randn(2, 4, 6, dtype=torch.float64, generator=generator)
    dense = fixed_point_stability(field, x, method="dense")
    lanc = fixed_point_stability(field, x, method="lanczos", iterations=16)  # 16 = N (D - 2): exact
    for d, s in zip(dense.samples, lanc.samples, strict=True):
        assert s.smallest == pytest.approx(d.smallest, abs=1e-8) and s.largest == pytest.approx(d.largest, abs=1e-8)
    # the mask matters: the unmasked spectrum differs
    unmasked = fixed_point_stability(ETField(model), x, method="dense")
    assert abs(unmasked.samples[0].smallest - dense.samples[0].smallest) > 1e-6
