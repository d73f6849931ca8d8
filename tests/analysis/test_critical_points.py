"""Critical points of any index against independent computations: root-finding in spherical coordinates with
scipy, Hessian eigenvalues by a generalized eigenproblem with the chart's metric, a closed-form saddle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import scipy.optimize
import torch

from et_ode import ETField
from et_ode.analysis.connections import disconnectivity, plot_disconnectivity, saddle_network
from et_ode.analysis.critical_points import (
    census,
    deduplicate,
    newton_critical_point,
    point_distance,
    saddle_from_minimum,
)
from et_ode.analysis.stability import find_fixed_point
from et_ode.dynamics.manifold import retract
from tests.analysis.test_stability import U1, U2, U3, closed_form, one_token_model
from tests.conftest import random_model

D, N = 4, 2


def spherical_model(seed: int = 3):
    return random_model(dim=D, heads=2, head_dim=2, memories=6, hopfield="softmax", beta_hn=2.0, seed=seed, eps=1e-6)


class Chart:
    """``g_A = delta + r B p(theta_A, phi_A)``, ``B`` an orthonormal basis of the centered subspace of R^4,
    ``r = gamma sqrt(D)`` (the radius of the flow's limit spheres), ``p`` the unit vector at polar angle
    ``theta`` and azimuth ``phi``. Energy, gradient and Hessian in the angles by autograd of the model's energy."""

    def __init__(self, model):
        self.model = model
        self.r = float(model.neuron.gamma.detach()) * math.sqrt(D)
        centered = torch.eye(D, dtype=torch.float64) - 1.0 / D
        self.basis = torch.linalg.svd(centered).U[:, :3]  # (D, 3)

    def g(self, angles: torch.Tensor) -> torch.Tensor:
        theta, phi = angles.reshape(N, 2).unbind(-1)
        p = torch.stack([theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos()], dim=-1)  # (N, 3)
        return self.model.neuron.delta.detach() + self.r * p @ self.basis.T

    def energy(self, angles: torch.Tensor) -> torch.Tensor:
        return self.model.energy_g(self.g(angles))

    def gradient(self, angles: np.ndarray) -> np.ndarray:
        a = torch.tensor(angles, dtype=torch.float64)
        return torch.autograd.functional.jacobian(self.energy, a).numpy()

    def hessian(self, angles: np.ndarray) -> np.ndarray:
        a = torch.tensor(angles, dtype=torch.float64)
        return torch.autograd.functional.hessian(self.energy, a).numpy()

    def metric(self, angles: np.ndarray) -> np.ndarray:
        a = torch.tensor(angles, dtype=torch.float64)
        jacobian = torch.autograd.functional.jacobian(lambda v: self.g(v).flatten(), a)  # (N D, 2 N)
        return (jacobian.T @ jacobian).numpy()


def chart_critical_points(chart: Chart, starts: int = 60, seed: int = 0) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """``(energy, g, generalized Hessian eigenvalues)`` of every root of the angle gradient found from random
    starts (away from the chart's poles, where it is singular)."""
    rng = np.random.default_rng(seed)
    found = []
    for _ in range(starts):
        start = np.stack([rng.uniform(0.3, math.pi - 0.3, N), rng.uniform(0, 2 * math.pi, N)], axis=-1).ravel()
        result = scipy.optimize.root(chart.gradient, start, jac=chart.hessian, method="hybr", tol=1e-13)
        angles = result.x
        theta = angles.reshape(N, 2)[:, 0]
        if not result.success or np.abs(np.sin(theta)).min() < 0.1 or np.abs(chart.gradient(angles)).max() > 1e-9:
            continue
        values = scipy.linalg.eigh(chart.hessian(angles), chart.metric(angles), eigvals_only=True)
        g = chart.g(torch.tensor(angles, dtype=torch.float64)).detach()
        found.append((float(chart.energy(torch.tensor(angles, dtype=torch.float64)).detach()), g, values))
    return found


def g_distance_modulo_permutation(a: torch.Tensor, b: torch.Tensor) -> float:
    return min(float((a - b[list(p)]).square().mean().sqrt()) for p in ((0, 1), (1, 0)))


def test_census_matches_root_finding_in_spherical_coordinates():
    model = spherical_model()
    field = ETField(model)
    reference = chart_critical_points(Chart(model))
    starts = torch.randn(25, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    found = census(field, starts)
    ours = [(e.point, model.neuron(e.point.x).detach()) for e in found.entries]
    assert [p.index for p, _ in ours] == [0, 2, 2, 3, 3, 4]  # one minimum, saddles of index 2 and 3, a maximum
    distinct_reference = []
    for energy, g, values in reference:
        if all(g_distance_modulo_permutation(g, other) > 1e-6 for _, other, _ in distinct_reference):
            distinct_reference.append((energy, g, values))
    # every critical point scipy finds is in our census, with the same energy and the same Hessian spectrum
    matched = 0
    for energy, g, values in distinct_reference:
        candidates = [p for p, ours_g in ours if g_distance_modulo_permutation(g, ours_g) < 1e-7]
        if not candidates:
            continue
        matched += 1
        point = candidates[0]
        assert point.energy == pytest.approx(energy, abs=1e-10)
        assert point.eigenvalues.numpy() == pytest.approx(np.sort(values), abs=1e-7)
        assert point.index == int((values < 0).sum())
    assert matched == len(distinct_reference) == len(ours)  # the same six points, no more, no fewer
    assert all(point.converged and point.rms_tangent_gradient < 1e-10 for point, _ in ours)


def test_newton_converges_to_a_saddle_next_to_it_where_descent_leaves():
    model = spherical_model()
    field = ETField(model)
    starts = torch.randn(10, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    saddle = census(field, starts, descent=False).points(2)[0]
    kick = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    start = retract(saddle.x, 1e-3 * kick, model.neuron.gamma.detach(), model.neuron.eps)  # 1e-3 in g
    newton = newton_critical_point(field, start)
    assert newton.converged and newton.index == 2
    assert point_distance(field, newton.x, saddle.x, permutations=False) < 1e-9
    descended = find_fixed_point(field, start[None], tol=1e-9).x[0]
    assert point_distance(field, descended, saddle.x, permutations=False) > 1e-2  # descent leaves the saddle


@pytest.mark.parametrize("sign", [1, -1])
def test_minimum_mode_following_finds_the_closed_form_saddle(sign: int):
    """One token, memories +-a u1 and +-c u3: from the minimum at u1 the softest mode points to u3, the index-1
    saddle whose eigenvalues are known in closed form."""
    model = one_token_model()
    field = ETField(model)
    saddle = saddle_from_minimum(field, U1[None] * 3.0, direction=sign)
    assert saddle.converged and saddle.index == 1 and saddle.kind == "saddle (index 1)"
    g = model.neuron(saddle.x).detach()[0]
    r = float(g.norm())
    overlap = float((g / r) @ U3)
    assert abs(overlap) == pytest.approx(1.0, abs=1e-10)
    assert saddle.eigenvalues.tolist() == pytest.approx(closed_form("u3", r), abs=1e-9)
    # Newton from near the maximum at u2 stays there (any index)
    maximum = newton_critical_point(field, (U2 + 0.05 * U1)[None] * 3.0)
    assert maximum.kind == "maximum" and maximum.converged


def test_deduplication_is_modulo_token_permutations_only_without_a_mask():
    model = spherical_model()
    field = ETField(model)
    point = newton_critical_point(field, torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
    swapped = newton_critical_point(field, point.x.flip(0))
    assert swapped.converged and point_distance(field, point.x, swapped.x, permutations=False) > 1e-3
    assert point_distance(field, point.x, swapped.x) < 1e-12
    assert [e.count for e in deduplicate(field, [point, swapped])] == [2]
    masked = ETField(model, mask=torch.tensor([[True, False], [True, True]]))
    assert len(deduplicate(masked, [point, swapped])) == 2  # a mask breaks the symmetry


def test_saddle_network_connects_minima_through_index_one_saddles(tmp_path):
    model = random_model(dim=5, heads=2, head_dim=3, memories=8, hopfield="softmax", seed=1)
    field = ETField(model)
    starts = torch.randn(30, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    found = census(field, starts)
    minima, saddles = found.points(0), found.points(1)
    assert len(minima) >= 2 and len(saddles) >= 1
    network = saddle_network(field, minima, saddles)
    for connection in network.connections:
        assert -1 not in connection.minima
        saddle = network.saddles[connection.saddle]
        for m, barrier in zip(connection.minima, connection.barriers, strict=True):
            assert barrier == pytest.approx(saddle.energy - network.minima[m].energy, abs=1e-12) and barrier > 0
        # a different descent (Riemannian gradient descent instead of the ODE) from the same pushes ends at the same minima
        steps = torch.stack([sign * 1e-3 * saddle.lowest_mode for sign in (1.0, -1.0)])
        pushed = retract(saddle.x.expand_as(steps), steps, model.neuron.gamma.detach(), model.neuron.eps)
        ends = find_fixed_point(field, pushed, tol=1e-9, max_iter=5000).x
        for end, m in zip(ends, connection.minima, strict=True):
            assert point_distance(field, end, network.minima[m].x) < 1e-6
    assert {m for c in network.connections for m in c.minima} == {0, 1}
    events = disconnectivity(network)
    assert events and events[0][1] == {0, 1}
    plot_disconnectivity(network, path=tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 5000
