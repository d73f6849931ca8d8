"""One sphere radius everywhere: the analysis (``find_fixed_point``, ``fixed_point_stability``,
``newton_critical_point``) and ``find_attractor`` place a minimum where the flow's limit is, on the spheres of
radius ``gamma sqrt(D)``, and agree on it and on its smallest eigenvalue, checked against the independent long
flow (:mod:`tests.reference_flow`) and a dense Riemannian Hessian of the SPEC's formulas
(``torch.autograd.functional.hessian``), at values of ``eps`` where a radius off by ``O(eps)`` shows."""

from __future__ import annotations

import math

import pytest
import torch

import et_ode
from et_ode import ETField, find_attractor
from et_ode.analysis.critical_points import newton_critical_point
from et_ode.analysis.stability import find_fixed_point, fixed_point_stability
from tests.conftest import random_model
from tests.reference_flow import SpecWeights, long_flow_limit

TAU = 1.7


def dense_smallest_eigenvalue(weights: SpecWeights, g: torch.Tensor) -> float:
    """The smallest eigenvalue of the Riemannian Hessian ``Q H Q^T - diag((s_A . dE/dg_A) / r)`` at ``g`` ``(N, D)``
    on the spheres of radius ``r = gamma sqrt(D)``: ``H`` the dense Hessian of the SPEC energy, ``Q`` an orthonormal
    basis of each token's tangent space (orthogonal to the all-ones vector and to ``s_A``) from a QR factorisation."""
    n, d = g.shape
    hessian = torch.autograd.functional.hessian(lambda v: weights.energy(v.reshape(n, d)), g.reshape(-1))
    gradient = weights.gradient(g)
    u = g - weights.delta
    u = u - u.mean(dim=-1, keepdim=True)
    s = u / u.norm(dim=-1, keepdim=True)
    rows, curvature = [], []
    for a in range(n):
        frame = torch.cat([torch.full((d, 1), d**-0.5, dtype=g.dtype), s[a, :, None], torch.eye(d, dtype=g.dtype)], 1)
        q, _ = torch.linalg.qr(frame)
        tangent = torch.zeros(d - 2, n, d, dtype=g.dtype)
        tangent[:, a] = q[:, 2:d].T
        rows.append(tangent.reshape(d - 2, n * d))
        curvature += [float(s[a] @ gradient[a]) / weights.radius] * (d - 2)
    basis = torch.cat(rows)
    matrix = basis @ hessian @ basis.T - torch.diag(torch.tensor(curvature, dtype=g.dtype))
    return float(torch.linalg.eigvalsh((matrix + matrix.T) / 2)[0])


@pytest.mark.parametrize("eps", [1e-3, 0.1])
def test_the_analysis_and_find_attractor_agree_on_the_flows_minimum(eps: float) -> None:
    model = random_model(6, 2, 3, 10, hopfield="softmax", beta=0.7, beta_hn=1.6, eps=eps, seed=11)
    field = ETField(model, tau=TAU)
    weights = SpecWeights.from_model(model)
    x0 = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    limit = long_flow_limit(weights, x0, tau=TAU)
    assert limit.converged and bool(limit.on_sphere.all())
    radius = float(model.neuron.gamma.detach()) * math.sqrt(6)
    # one start on the flow's path, from which the analysis descends and find_attractor flows on
    with torch.no_grad():
        start = et_ode.solve(field, x0[None], (0.0, 30.0), save="final").x
    found = find_attractor(field, start)
    descended = find_fixed_point(field, start, tol=1e-10)
    assert found.status == ("certified",) and descended.attractor.status == ("certified",)
    polished = newton_critical_point(field, descended.x[0], tol=1e-11)
    assert polished.converged and polished.index == 0
    for x in (found.x[0], descended.x[0], polished.x):
        g = model.neuron(x).detach()
        assert float((g - limit.g).norm()) < 1e-6, (eps, float((g - limit.g).norm()))
        lengths = (g - model.neuron.delta.detach()).norm(dim=-1)
        torch.testing.assert_close(lengths, torch.full_like(lengths, radius), rtol=1e-12, atol=0)
    smallest = dense_smallest_eigenvalue(weights, limit.g)
    stability = fixed_point_stability(field, descended.x, method="dense")
    assert stability.samples[0].kind == "stable attractor"
    for value in (float(found.smallest_eigenvalue[0]), stability.samples[0].smallest, float(polished.eigenvalues[0])):
        assert value == pytest.approx(smallest, rel=1e-6, abs=1e-9), (eps, value, smallest)
    assert float(found.energy[0]) == pytest.approx(limit.energy, rel=1e-10)
