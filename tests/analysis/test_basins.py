"""Basins against closed forms: a reflection-symmetric one-token model whose basin boundary is a known
hyperplane, and Wilson intervals against the inversion of the score test."""

from __future__ import annotations

import math

import pytest
import scipy.optimize
import torch

from et_ode import ETField
from et_ode.analysis.basins import attractor_census, basin_map, plot_basin_map, wilson_interval
from tests.analysis.test_stability import U1, U3, one_token_model


@pytest.mark.parametrize(("successes", "trials"), [(0, 10), (3, 10), (29, 40), (40, 40), (1, 1)])
def test_wilson_interval_inverts_the_score_test(successes: int, trials: int):
    low, high = wilson_interval(successes, trials)
    p_hat, z = successes / trials, 1.96

    def score(p0: float) -> float:  # the score test accepts p0 where |p_hat - p0| <= z sqrt(p0 (1 - p0) / n)
        return abs(p_hat - p0) - z * math.sqrt(p0 * (1 - p0) / trials)

    inner = min(max(p_hat, 1e-12), 1 - 1e-12)  # the score is negative there
    expected_low = scipy.optimize.brentq(score, 0.0, inner, xtol=1e-15) if p_hat > 0 else 0.0
    expected_high = scipy.optimize.brentq(score, inner, 1.0, xtol=1e-15) if p_hat < 1 else 1.0
    assert low == pytest.approx(expected_low, abs=1e-12) and high == pytest.approx(expected_high, abs=1e-12)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 3)


def test_basin_map_of_a_reflection_symmetric_model(tmp_path):
    """Memories +-a u1, +-c u3: the energy is symmetric under g -> g - 2 (g . u1) u1, so the hyperplane g . u1 = 0
    is invariant: starts with g . u1 > 0 reach the minimum at +u1, those with g . u1 < 0 the one at -u1, and
    starts on the hyperplane stay on it and end at a saddle (+-u3)."""
    model = one_token_model()
    field = ETField(model)
    saddle, through = U3[None] * 2.0, torch.stack([U1[None] * 2.0, -U1[None] * 2.0])
    basins = basin_map(field, saddle, through, resolution=9)
    g = basins.slice.points(*reversed(torch.meshgrid(basins.grid, basins.grid, indexing="ij")))  # (R, R, 1, D)
    side = (g[..., 0, :] @ U1).detach()
    for label, attractor in enumerate(basins.attractors):
        chosen = basins.labels == label
        overlap = float(model.neuron(attractor.x)[0].detach() @ U1) / float(model.neuron(attractor.x).detach().norm())
        if attractor.index == 0:
            assert abs(overlap) == pytest.approx(1.0, abs=1e-9)
            assert bool((side[chosen] * overlap > 1e-9).all())  # every start on its side of the hyperplane
        else:
            assert attractor.index == 1 and abs(overlap) < 1e-9
            assert bool((side[chosen].abs() < 1e-9).all())
    assert sorted(a.index for a in basins.attractors).count(0) == 2
    assert int((basins.labels == -1).sum()) == 0
    plot_basin_map(basins, marks={"saddle": saddle}, path=tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 5000


def test_attractor_census_counts_and_intervals():
    model = one_token_model()
    field = ETField(model)
    starts = torch.randn(24, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    census = attractor_census(field, starts)
    assert census.starts == 24 and sum(census.counts) + census.failed == 24
    assert len(census.attractors) == 2 and all(a.index == 0 for a in census.attractors)  # the minima at +-u1
    expected = sum(float(model.neuron(x[None])[0, 0].detach() @ U1) > 0 for x in starts)  # the side decides
    assert sorted(census.counts) == sorted([expected, 24 - expected])
    for count, interval in zip(census.counts, census.intervals, strict=True):
        assert interval == wilson_interval(count, 24)
    assert "Wilson" in census.table()
