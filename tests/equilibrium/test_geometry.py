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

from et_ode import EnergyTransformer, ETField, find_attractor
from tests.reference_flow import SpecWeights

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
