"""Continuation against closed forms: a symmetry-forced pitchfork whose parameter is known exactly, and a fold
located independently by root-finding on (angles, parameter) in spherical coordinates with scipy."""

from __future__ import annotations

import math

import pytest
import scipy.optimize
import torch

from et_ode import EnergyTransformer, ETField
from et_ode.analysis.continuation import ArcLength, continue_branch, plot_bifurcation_diagram
from et_ode.analysis.critical_points import newton_critical_point
from tests.analysis.test_stability import BETA, U1, U2, U3, C

ZEROS = torch.zeros(1, 1, 4, dtype=torch.float64)


def one_token(xi: torch.Tensor, beta_hn: float) -> EnergyTransformer:
    return EnergyTransformer.from_tensors(
        ZEROS, ZEROS, xi, 1.0, torch.zeros(4, dtype=torch.float64), hopfield="softmax", beta_hn=beta_hn, eps=1e-12
    )


def symmetric(a: float) -> EnergyTransformer:
    """Memories +-a u1, +-c u3: g . u1 -> -g . u1 is a symmetry, and u3 a critical point for every a."""
    return one_token(torch.stack([a * U1, -a * U1, C * U3, -C * U3]), BETA)


def test_pitchfork_at_the_closed_form_parameter(tmp_path):
    """At u3 the eigenvalue towards u1 is (2 c sinh(beta c r) / r - 2 beta a^2) / z: it vanishes at
    a* = sqrt(c sinh(beta c r) / (beta r)), r = 2, where the reflection symmetry forces a pitchfork."""
    r = 2.0 * math.sqrt(1 - 1e-12)
    a_star = math.sqrt(C * math.sinh(BETA * C * r) / (BETA * r))
    branch = continue_branch(symmetric, U3[None] * 2.0, 1.0, mu_end=0.3, arclength=ArcLength(step=0.1))
    assert [b.kind for b in branch.bifurcations] == ["branch point"]
    point = branch.bifurcations[0]
    assert point.mu == pytest.approx(a_star, abs=1e-9)
    assert (point.index_before, point.index_after) == (1, 0)
    # the branch stays at u3 (the symmetric critical point) all along
    g = branch.xs / branch.xs.norm(dim=-1, keepdim=True)
    assert float((g[:, 0] @ U3).abs().min()) == pytest.approx(1.0, abs=1e-9)
    # the pitchfork's side branches: below a*, two mirror-image saddles tilted toward +-u1 by ~ sqrt(a* - a)
    tilts = []
    for below, start in ((0.01, 0.3), (0.0025, 0.15)):
        field = ETField(symmetric(a_star - below))
        pair = [newton_critical_point(field, (U3 + sign * start * U1)[None] * 2.0) for sign in (1.0, -1.0)]
        overlaps = [float(p.x[0] @ U1) / float(p.x.norm()) for p in pair]
        assert all(p.converged and p.index == 1 for p in pair)
        assert overlaps[0] == pytest.approx(-overlaps[1], abs=1e-9) and pair[0].energy == pytest.approx(pair[1].energy)
        tilts.append(overlaps[0])
    assert tilts[0] / tilts[1] == pytest.approx(2.0, rel=0.03)  # a square root: a pitchfork, not a transcritical
    plot_bifurcation_diagram([branch], parameter="a", path=tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 5000


def asymmetric(c: float) -> EnergyTransformer:
    """Memories u1 and c u3 (beta 2): the minimum near u3 meets a saddle and disappears as c falls (a fold)."""
    return one_token(torch.stack([U1, c * U3]), 2.0)


def fold_by_root_finding(guess: tuple[float, float, float]) -> float:
    """Solve dE/dtheta = dE/dphi = det(Hessian in the angles) = 0 for (theta, phi, c) with scipy: at a critical
    point the chart's Hessian is J^T Hess_R J, singular exactly where Hess_R is."""

    def energy(angles: torch.Tensor, c: float) -> torch.Tensor:
        theta, phi = angles
        p = theta.sin() * phi.cos() * U1 + theta.sin() * phi.sin() * U3 + theta.cos() * U2
        return asymmetric(c).energy_g((2.0 * math.sqrt(1 - 1e-12) * p)[None])

    def equations(unknowns):
        angles, c = torch.tensor(unknowns[:2], dtype=torch.float64), float(unknowns[2])
        gradient = torch.autograd.functional.jacobian(lambda a: energy(a, c), angles)
        hessian = torch.autograd.functional.hessian(lambda a: energy(a, c), angles)
        return [float(gradient[0]), float(gradient[1]), float(torch.linalg.det(hessian))]

    result = scipy.optimize.root(equations, list(guess), method="hybr", tol=1e-12)
    assert result.success and max(abs(v) for v in equations(result.x)) < 1e-9
    return float(result.x[2])


def test_fold_matches_root_finding_in_spherical_coordinates():
    start = newton_critical_point(ETField(asymmetric(1.0)), U3[None] * 2.0)
    assert start.index == 0
    branch = continue_branch(asymmetric, start.x, 1.0, mu_end=0.2)
    folds = [b for b in branch.bifurcations if b.kind == "fold"]
    assert len(folds) == 1 and (folds[0].index_before, folds[0].index_after) == (0, 1)
    expected = fold_by_root_finding((math.pi / 2, 1.2, 0.7))
    assert folds[0].mu == pytest.approx(expected, abs=2e-4)
    assert float(branch.mu.min()) == pytest.approx(expected, abs=2e-3)  # the branch turns back there
    assert float(branch.mu[-1]) > 1.0  # and returns as a saddle branch past mu0


def test_continue_branch_refuses_its_arguments_by_name():
    with pytest.raises(TypeError, match="arclength must be an ArcLength"):
        continue_branch(symmetric, U3[None] * 2.0, 1.0, mu_end=0.3, arclength=dict(step=0.1))
    with pytest.raises(ValueError, match="mu_end must differ from mu0"):
        continue_branch(symmetric, U3[None] * 2.0, 1.0, mu_end=1.0)
