"""The settings objects of the analysis (Benettin, RegimeTests, ArcLength) refuse a bad value on construction, by
its name; their defaults are valid."""

from __future__ import annotations

import pytest

from et_ode import Adaptive, Fixed
from et_ode.analysis import ArcLength, Benettin, RegimeTests

BAD = [
    (Benettin, dict(t1=0.0), "Benettin.t1"),
    (Benettin, dict(d0=-1e-6), "Benettin.d0"),
    (Benettin, dict(renormalizations=2.0), "Benettin.renormalizations"),
    (Benettin, dict(renormalizations=True), "Benettin.renormalizations"),
    (Benettin, dict(solver=Adaptive("tsit5")), "Benettin.solver's method"),
    (RegimeTests, dict(slope_tol=0.0), "RegimeTests.slope_tol"),
    (RegimeTests, dict(scale_tol=-0.01), "RegimeTests.scale_tol"),
    (RegimeTests, dict(floor=float("inf")), "RegimeTests.floor"),
    (RegimeTests, dict(tail=1.5), "RegimeTests.tail"),
    (ArcLength, dict(step=0.0), "ArcLength.step"),
    (ArcLength, dict(tol=-1e-10), "ArcLength.tol"),
    (ArcLength, dict(difference=float("inf")), "ArcLength.difference"),
    (ArcLength, dict(zero_tol=0), "ArcLength.zero_tol"),
    (ArcLength, dict(max_points=1), "ArcLength.max_points"),
    (ArcLength, dict(max_points=10.0), "ArcLength.max_points"),
]


@pytest.mark.parametrize("settings, values, named", BAD, ids=[named for _, _, named in BAD])
def test_a_bad_setting_is_refused_by_name(settings, values, named):
    with pytest.raises(ValueError, match=named):
        settings(**values)


def test_a_seed_is_an_integer_and_a_solver_an_adaptive():
    with pytest.raises(TypeError, match="Benettin.seed"):
        Benettin(seed=1.5)
    with pytest.raises(TypeError, match="Benettin.solver"):
        Benettin(solver=Fixed("rk4", 0.1))


@pytest.mark.parametrize("settings", [Benettin, RegimeTests, ArcLength])
def test_the_defaults_are_valid_and_frozen(settings):
    made = settings()
    assert made == settings()
    with pytest.raises(AttributeError):
        made.tol = 1.0
