"""``find_attractor`` returns the limit of the flow that starts at ``x0``, or says it cannot (status ``"unsettled"``),
never another minimum as the flow's: checked against an independent long flow (:mod:`tests.reference_flow`)."""

from __future__ import annotations

import pytest
import torch

from et_ode import EnergyTransformer, ETField, find_attractor
from et_ode.equilibrium.certify import basin_settled
from tests.reference_flow import SpecWeights, long_flow_limit


def random_case(seed: int, form: str, *, dim: int = 8, tokens: int = 4) -> tuple[EnergyTransformer, torch.Tensor]:
    """A random float64 model (2 heads of 3, 2 dim memories), gamma and delta perturbed on odd seeds, and one x0."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = 0.5) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator, dtype=torch.float64)

    gamma, delta = 1.0, torch.zeros(dim, dtype=torch.float64)
    if seed % 2:
        gamma, delta = 1.0 + 0.3 * float(torch.rand(1, generator=generator)), draw(dim, scale=0.1)
    model = EnergyTransformer.from_tensors(draw(2, 3, dim), draw(2, 3, dim), draw(2 * dim, dim), gamma, delta, hopfield=form)
    return model, draw(1, tokens, dim, scale=1.0)


def check_against_the_flow(model: EnergyTransformer, x0: torch.Tensor, **options: object) -> str:
    """Run ``find_attractor`` and the reference flow; a certified result must be the flow's limit (1e-6 in g)."""
    found = find_attractor(ETField(model), x0, **options)  # type: ignore[arg-type]
    limit = long_flow_limit(SpecWeights.from_model(model), x0[0])
    assert limit.converged
    distance = float((found.g.detach()[0] - limit.g).norm())
    if found.status[0] == "certified":
        assert distance < 1e-6, (found.status, distance, float(found.energy), limit.energy)
    return found.status[0]


@pytest.mark.parametrize(
    "form", ["softmax", pytest.param("relu", marks=pytest.mark.slow), pytest.param("softplus", marks=pytest.mark.slow)]
)
def test_the_default_search_returns_the_flows_own_limit(form: str) -> None:
    assert check_against_the_flow(*random_case(1, form)) == "certified"


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_newton_straight_from_x0_never_certifies_another_minimum(seed: int) -> None:
    """A hand-off level above any gradient hands ``x0`` itself to Newton, which need not stay in the flow's basin:
    the basin test must then refuse (``"unsettled"``) rather than certify the point Newton found."""
    model, x0 = random_case(seed, "softmax")
    status = check_against_the_flow(model, x0, handoff=1e6, handoffs=1)
    assert status in ("certified", "unsettled")


def test_the_flow_is_never_certified_at_a_newton_point_of_another_basin() -> None:
    """A first hand-off level just above ``x0``'s RMS ``|T dE/dg|`` hands ``x0`` itself to Newton, which (seed 1)
    finds a minimum 1.9 from the flow's limit, unsettled there. Flowing on to the next level, in short segments, the
    flow is watched against that point between its segments (and certified there once the basin test ties them): it
    must not be, and the search ends at the flow's own limit."""
    model, x0 = random_case(1, "softmax")
    field = ETField(model)
    limit = long_flow_limit(SpecWeights.from_model(model), x0[0])
    assert limit.converged
    with torch.no_grad():
        level = 1.01 * float(field.tangent_gradient(x0).square().mean().sqrt())
    newton = find_attractor(field, x0, handoff=level, handoffs=1)
    assert newton.status == ("unsettled",) and float((newton.g.detach()[0] - limit.g).norm()) > 1.0
    found = find_attractor(field, x0, handoff=level, handoffs=8, segment=1.0)
    assert found.status == ("certified",) and float((found.g.detach()[0] - limit.g).norm()) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("form", ["relu", "softmax", "softplus"])
@pytest.mark.parametrize("seed", range(2, 12))
def test_random_seeds_end_at_the_flows_limit_or_say_unsettled(form: str, seed: int) -> None:
    model, x0 = random_case(seed, form, dim=12, tokens=6)
    for options in ({}, {"handoff": 1e6, "handoffs": 1}):
        assert check_against_the_flow(model, x0, **options) in ("certified", "unsettled")


def test_the_basin_test_refuses_a_start_in_another_basin() -> None:
    """Two tokens with minima at +-xi1 each (the label tests' model): a start near one minimum is settled for it and
    not for the mirrored one, and a start on the far side is not settled for the near minimum."""
    from tests.equilibrium.test_labels import _model, _plane, _state

    field = ETField(_model(0.8))
    xi1, xi2 = _plane()
    plus = find_attractor(field, _state([xi1, xi1]), flow=False)
    minus = find_attractor(field, _state([-xi1, xi1]), flow=False)
    assert plus.status == minus.status == ("certified",)
    near_plus = _state([xi1 + 0.05 * xi2, xi1 - 0.03 * xi2])
    starts = torch.cat([near_plus, near_plus, _state([-xi1 + 0.05 * xi2, xi1])])
    found = torch.cat([plus.x, minus.x, plus.x])
    smallest = torch.cat([plus.smallest_eigenvalue, minus.smallest_eigenvalue, plus.smallest_eigenvalue])
    settled = basin_settled(field, starts, found, smallest, ["spheres"] * 3, tol=1e-8)
    assert settled.tolist() == [True, False, False]
    assert basin_settled(field, starts[:1], found[:1], smallest[:1], ["mixed"], tol=1e-8).tolist() == [False]
