"""Attractor labels and geometry at points built exactly, against their closed-form spectra.

A model with no attention (``WK = WQ = 0``) and the ReLU memories ``+-(xi1 + a xi2)``, ``+-(xi1 - a xi2)`` (``xi1``,
``xi2`` centred and orthonormal) has, per token and wherever no overlap vanishes, ``E = -(xi1 . g)^2 - a^2 (xi2 . g)^2``
on the sphere of radius ``r = gamma sqrt(D)``. Its Riemannian Hessian at ``g = r xi1`` has the eigenvalues
``2 (1 - a^2)`` (along ``xi2``) and ``2`` (the rest); at ``g = r xi2`` they are ``-2 (1 - a^2)`` (along ``xi1``) and
``2 a^2``. So ``a < 1`` gives a strict minimum and an index-1 saddle per token, and ``a = 1`` a circle of minima per
token with an exact zero mode: three labels at known points, none on a kink of the ReLU.
"""

from __future__ import annotations

import math

import pytest
import torch

from et_ode import EnergyTransformer, ETField, find_attractor

D, N = 5, 2


def _plane() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    basis = torch.randn(D, 2, generator=generator, dtype=torch.float64)
    basis = basis - basis.mean(dim=0, keepdim=True)
    q, _ = torch.linalg.qr(basis)
    return q[:, 0], q[:, 1]


def _model(a: float, gamma: float = 1.3) -> EnergyTransformer:
    xi1, xi2 = _plane()
    zeros = torch.zeros(1, 2, D, dtype=torch.float64)
    memories = torch.stack([xi1 + a * xi2, xi1 - a * xi2, -xi1 - a * xi2, -xi1 + a * xi2])
    return EnergyTransformer.from_tensors(
        zeros, zeros.clone(), memories, gamma, torch.zeros(D, dtype=torch.float64), eps=1e-5
    )


def _state(directions: list[torch.Tensor]) -> torch.Tensor:
    """Tokens along the given centred unit directions, at a large scale (g on its limit sphere to rounding)."""
    return 1e4 * torch.stack(directions)[None]


@pytest.mark.parametrize("gamma", [1.0, 1.3])
def test_a_strict_minimum_is_stable_with_its_closed_form_eigenvalue(gamma: float) -> None:
    a = 0.8
    xi1, _ = _plane()
    found = find_attractor(ETField(_model(a, gamma)), _state([xi1, -xi1]), flow=False)
    assert found.kind == ("stable",) and found.status == ("certified",) and found.geometry == ("spheres",)
    # the eigenvalues do not depend on the radius: 2 (1 - a^2) whatever gamma
    assert float(found.smallest_eigenvalue) == pytest.approx(2 * (1 - a * a), rel=1e-8)
    assert float(found.largest_eigenvalue) == pytest.approx(2.0, rel=1e-8)
    assert float(found.outward_force) == pytest.approx(2 * gamma * math.sqrt(D), rel=1e-6)  # -s . dE/dg = 2 r


def test_an_index_one_point_is_a_saddle() -> None:
    a = 0.8
    xi1, xi2 = _plane()
    found = find_attractor(ETField(_model(a)), _state([xi1, xi2]), flow=False)
    assert found.kind == ("saddle",) and found.status == ("saddle",)
    assert not bool(found.certified.any())
    assert float(found.smallest_eigenvalue) == pytest.approx(-2 * (1 - a * a), rel=1e-8)
    # the outward force is the smaller of the two tokens' rho = 2 r (on xi1) and 2 a^2 r (on xi2)
    assert float(found.outward_force) == pytest.approx(2 * a * a * 1.3 * math.sqrt(D), rel=1e-6)


def test_a_circle_of_minima_is_degenerate() -> None:
    xi1, xi2 = _plane()
    turned = math.cos(0.3) * xi1 + math.sin(0.3) * xi2  # no overlap vanishes there
    found = find_attractor(ETField(_model(1.0)), _state([turned, -turned]), flow=False)
    assert found.kind == ("degenerate",) and found.status == ("degenerate",)
    assert abs(float(found.smallest_eigenvalue)) < 1e-10
    assert not bool(found.certified.any())


def test_the_flow_from_near_the_saddle_ends_certified_at_a_minimum() -> None:
    a = 0.8
    xi1, xi2 = _plane()
    start = _state([xi1, xi2]) * 1e-4 + 1e-2 * torch.randn(
        1, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    found = find_attractor(ETField(_model(a)), start)
    assert found.status == ("certified",)
    assert float(found.smallest_eigenvalue) == pytest.approx(2 * (1 - a * a), rel=1e-6)
    g = found.g.detach()[0] / (1.3 * math.sqrt(D))
    assert (g @ xi1).abs().min() == pytest.approx(1.0, abs=1e-8)  # both tokens on +-xi1
