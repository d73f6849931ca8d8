"""Which geometry an attractor is certified in, checked with the energy written out again (``tests.reference_flow``).

Independent tokens (an identity mask with self-attention, ``WQ = -WK``) have, each, the energy
``e(g) = |WK g|^2 - (1/2) sum relu(xi . g)^2``, homogeneous of degree 2 in ``g`` (``delta = 0``): its outward force on
the sphere is ``rho = -2 e(g) / r``. A token where ``e > 0`` shrinks towards ``g = 0`` (a fixed point at finite
scale), one where ``e < 0`` heads for its sphere: a state with both is of neither geometry.
"""

from __future__ import annotations

import math

import pytest
import torch

from et_ode import EnergyTransformer, ETField, find_attractor, solve
from et_ode.analysis.critical_points import newton_critical_point
from tests.reference_flow import SpecWeights, long_flow_limit

D = 6


def independent_tokens(memory_scale: float) -> tuple[EnergyTransformer, torch.Tensor, SpecWeights]:
    generator = torch.Generator().manual_seed(4)
    wk = 0.6 * torch.randn(1, 3, D, generator=generator, dtype=torch.float64)
    xi = memory_scale * torch.randn(2, D, generator=generator, dtype=torch.float64)
    model = EnergyTransformer.from_tensors(wk, -wk, xi, 1.0, torch.zeros(D, dtype=torch.float64), self_attention=True)
    return model, torch.eye(2, dtype=torch.bool), SpecWeights.from_model(model)


def residuals(weights: SpecWeights, mask: torch.Tensor, g: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """RMS ``|T dE/dg|``, RMS of the centred ``dE/dg`` and each token's ``rho``, from the spec's formulas."""
    grad = weights.gradient(g, mask)
    centred = grad - grad.mean(dim=-1, keepdim=True)
    u = g - weights.delta
    u = u - u.mean(dim=-1, keepdim=True)
    s = u / u.norm(dim=-1, keepdim=True)
    rho = -(s * centred).sum(dim=-1)
    tangent = centred + rho[..., None] * s
    return float(tangent.square().mean().sqrt()), float(centred.square().mean().sqrt()), rho


def starts() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, 2, D, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("memory_scale", [0.4, 1.5])
@pytest.mark.parametrize("flow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_certified_point_holds_its_geometry_by_the_spec_formulas(memory_scale: float, flow: bool) -> None:
    """Whatever the start and whether the flow runs: a certified point on the spheres has every token pushing
    outward and a vanishing tangent gradient; one in ``x`` a vanishing centred gradient (not one that is small only
    because the tokens grew); nothing else is certified."""
    model, mask, weights = independent_tokens(memory_scale)
    found = find_attractor(ETField(model, mask=mask), starts(), flow=flow)
    assert "certified" in found.status  # something to check
    for b, status in enumerate(found.status):
        if status != "certified":
            continue
        tangent, centred, rho = residuals(weights, mask, found.g.detach()[b])
        if found.geometry[b] == "spheres":
            assert bool((rho > 0).all()) and tangent < 1e-7, (memory_scale, flow, b, rho, tangent)
            assert math.isclose(float(found.outward_force[b]), float(rho.min()), rel_tol=1e-6)
        else:
            assert found.geometry[b] == "x" and centred < 1e-7, (memory_scale, flow, b, centred)


def passing_model() -> tuple[EnergyTransformer, torch.Tensor, torch.Tensor]:
    """Two independent tokens (identity mask, self-attention with ``WQ = -WK``), ``D = 4``: per token
    ``e(g) = g^T K g - (1/2) relu(xi . g)^2`` with ``K = 0.2 e1 e1^T + e2 e2^T + e3 e3^T`` and
    ``xi = 2 (cos 0.5 e3 - sin 0.5 e1)`` (``e1, e2, e3`` orthonormal and centred), ``delta = xi / 4``.

    Near ``e1`` the memory is silent, so a token there sits at a stable critical point of its sphere where it pulls
    inward (``rho < 0``); the global minimum lies near ``xi``, where it pushes outward. Returns the model, its mask
    and a sphere critical point ``(2, D)`` with one token of each kind (found by Newton from ``(e1, xi)``)."""
    q, _ = torch.linalg.qr(
        torch.cat([torch.ones(4, 1), torch.randn(4, 3, generator=torch.Generator().manual_seed(0))], 1).double()
    )
    e1, e2, e3 = q[:, 1], q[:, 2], q[:, 3]
    wk = torch.stack([math.sqrt(0.2) * e1, e2, e3])[None]
    xi = math.cos(0.5) * e3 - math.sin(0.5) * e1
    model = EnergyTransformer.from_tensors(wk, -wk, 2.0 * xi[None], 1.0, 0.5 * xi, self_attention=True)
    mask = torch.eye(2, dtype=torch.bool)
    point = newton_critical_point(ETField(model, mask=mask), torch.stack([e1, xi]), tol=1e-12)
    assert point.converged and point.index == 0  # stable on the spheres
    return model, mask, point.x


def test_a_flow_past_a_sphere_point_with_an_inward_token_is_never_certified_there() -> None:
    """The flow from next to the sphere point ``P`` (one token pulling inward) shrinks that token through
    ``x = 0`` and settles 3.8 away at a lower energy: ``find_attractor`` returns that limit, certified, or a
    status that is not ``"certified"``; never ``P``, from ``P`` itself or from next to it, flowing or not."""
    model, mask, x_point = passing_model()
    weights = SpecWeights.from_model(model)
    field = ETField(model, mask=mask)
    g_point = model.neuron(x_point).detach()
    tangent, _, rho = residuals(weights, mask, g_point)
    assert tangent < 1e-10 and float(rho[0]) < -0.5 and float(rho[1]) > 1.0
    x_unit = x_point / x_point.square().mean(dim=-1, keepdim=True).sqrt()
    x0 = x_unit + 0.02 * torch.randn(2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    limit = long_flow_limit(weights, x0, mask=mask)
    assert limit.converged and float((limit.g - g_point).norm()) > 3.0
    assert limit.energy < float(weights.energy(g_point, mask)) - 5.0
    with torch.no_grad():  # the inward token passes through x = 0 on the way
        path = solve(field, x0[None], torch.logspace(-2, 3, 300, dtype=torch.float64)).xs[:, 0]
    scales = (path - path.mean(dim=-1, keepdim=True)).norm(dim=-1)
    assert float(scales[:, 0].min()) < 0.05 * float(scales[0, 0]) and float(scales[-1, 0]) > float(scales[0, 0])
    starts = {
        "next to P": (x0, {}),
        "P at scale 1": (x_unit, {}),
        "next to P, Newton at once": (x0, {"handoff": 1e6, "handoffs": 1}),
        "P on its spheres, no flow": (x_point, {"flow": False}),
    }
    for name, (start, options) in starts.items():
        found = find_attractor(field, start[None], **options)  # type: ignore[arg-type]
        distance = float((found.g.detach()[0] - limit.g).norm())
        assert float((found.g.detach()[0] - g_point).norm()) > 1.0 or found.status[0] != "certified", name
        if found.status[0] == "certified":
            assert distance < 1e-6, (name, distance)
