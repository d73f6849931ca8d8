"""The long-flow reference against limits known in closed form: a minimum on the spheres (one Hopfield memory,
no attention) and a fixed point in ``x`` at finite scale (a convex self-attention energy, no memory)."""

from __future__ import annotations

import math

import pytest
import torch

from et_ode import EnergyTransformer
from tests.reference_flow import SpecWeights, long_flow_limit

D = 5


def one_memory(form: str, gamma: float = 1.3) -> tuple[EnergyTransformer, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    xi = torch.randn(1, D, dtype=torch.float64, generator=generator)
    delta = 0.2 * torch.randn(D, dtype=torch.float64, generator=generator)
    zero = torch.zeros(1, 2, D, dtype=torch.float64)
    return EnergyTransformer.from_tensors(zero, zero, xi, gamma, delta, hopfield=form), xi[0]


@pytest.mark.parametrize("form", ["relu", "softmax"])
def test_one_memory_flows_to_the_centred_memory_direction_on_the_sphere(form: str):
    """With no attention each token maximizes its overlap with the memory on its sphere: ``g* - delta =
    gamma sqrt(D) xi_c / |xi_c|``, for both rectified (relu) and linear (softmax with one memory) overlaps."""
    model, xi = one_memory(form)
    weights = SpecWeights.from_model(model)
    centred = xi - xi.mean()
    # starts with a positive overlap (the ReLU energy is flat where it is negative), far from the answer
    x0 = torch.stack(
        [
            centred + torch.tensor([2.0, -1.0, 0.5, 0.3, -1.5], dtype=torch.float64),
            0.3 * centred + torch.tensor([-0.4, 1.0, 1.2, -1.0, 0.1], dtype=torch.float64),
        ]
    )
    assert bool((spec_overlap(weights, x0) > 0).all())
    limit = long_flow_limit(weights, x0, tau=0.7, rtol=1e-8)  # (one attractor: the path's accuracy is not tested)
    expected = weights.delta + 1.3 * math.sqrt(D) * centred / centred.norm()
    assert limit.converged and limit.residual < 1e-11 and limit.tangent_gradient < 1e-11
    assert bool(limit.on_sphere.all()) and bool((limit.rho > 0).all())
    assert (limit.g - expected).abs().max().item() < 1e-9
    overlap = float(expected @ xi)
    assert limit.energy == pytest.approx(-0.5 * 2 * overlap**2 if form == "relu" else -2 * overlap, rel=1e-12)
    # the scale grew (exponentially in s) and was shrunk between segments: it stays bounded
    sigma = (limit.x.square().mean(dim=-1) + weights.eps).sqrt()
    assert bool((sigma > 1e8 * math.sqrt(weights.eps) * 0.999).all()) and bool((sigma < 1e15).all())


def spec_overlap(weights: SpecWeights, x: torch.Tensor) -> torch.Tensor:
    xt = x - x.mean(dim=-1, keepdim=True)
    g = weights.gamma * xt / (xt.square().mean(dim=-1, keepdim=True) + weights.eps).sqrt() + weights.delta
    return g @ weights.xi[0]


def test_an_inward_flow_settles_at_its_finite_scale_fixed_point():
    """``E = k sum_A |g_A|^2`` (self-attention on the identity mask with ``WQ = -WK = -sqrt(k) I``, no memory):
    convex in ``g``, its centred gradient vanishes at ``g_A = mean(delta) 1``, inside the sphere when
    ``|delta_c| < gamma sqrt(D)``. There ``x_A`` points along ``-delta_c`` with ``sigma^2 = eps / (1 - q)``,
    ``q = |delta_c|^2 / (gamma^2 D)``: the flow shrinks ``x`` and must not be rescaled."""
    k, gamma, eps = 0.8, 0.9, 0.5
    delta = torch.tensor([0.7, -0.2, 0.4, -0.6, 0.3], dtype=torch.float64)
    WK = math.sqrt(k) * torch.eye(D, dtype=torch.float64)[None]
    model = EnergyTransformer.from_tensors(
        WK, -WK, torch.zeros(1, D, dtype=torch.float64), gamma, delta, eps=eps, self_attention=True
    )
    weights = SpecWeights.from_model(model)
    x0 = torch.tensor([[3.0, 1.0, -2.0, 0.5, 0.2], [-1.0, 4.0, 0.0, 2.0, -3.0]], dtype=torch.float64)
    mask = torch.eye(2, dtype=torch.bool)
    limit = long_flow_limit(weights, x0, mask=mask)
    delta_c = delta - delta.mean()
    q = float(delta_c.square().sum()) / (gamma**2 * D)
    assert 0 < q < 1
    assert limit.converged and not bool(limit.on_sphere.any())
    assert (limit.g - delta.mean()).abs().max().item() < 1e-10
    sigma = (limit.x.square().mean(dim=-1) + eps).sqrt()
    assert sigma.tolist() == pytest.approx([math.sqrt(eps / (1 - q))] * 2, rel=1e-9)
    direction = limit.x / limit.x.norm(dim=-1, keepdim=True)
    assert (direction + delta_c / delta_c.norm()).abs().max().item() < 1e-9
    assert limit.energy == pytest.approx(2 * k * D * float(delta.mean()) ** 2, rel=1e-10)
    assert limit.rho.abs().max().item() < 1e-10


def test_x0_must_be_one_state():
    model, _ = one_memory("relu")
    with pytest.raises(ValueError, match="one state"):
        long_flow_limit(SpecWeights.from_model(model), torch.zeros(1, 2, D, dtype=torch.float64))
