"""The one positive-number validator (et_ode.backend.validation.check_positive) and the settings that use it: what
each accepts and refuses, and a message that names the setting."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest

import et_ode
from et_ode.backend.validation import check_positive


@pytest.mark.parametrize("value", [1, 2.5, 1e-300, 10**9])
def test_a_positive_finite_number_passes(value):
    check_positive("x", value)


@pytest.mark.parametrize("value", [0, -1, -0.5, 0.0, math.inf, math.nan, True, "1", None, [1]])
def test_anything_else_is_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=r"^Thing\.x must be a positive finite number, got "):
        check_positive("Thing.x", value)


@pytest.mark.parametrize("value", [1.0, 2.5, True, 0, -3])
def test_an_integer_setting_refuses_floats_bools_and_non_positive_integers(value):
    with pytest.raises(ValueError, match=r"^steps must be a positive integer, got "):
        check_positive("steps", value, integer=True)
    check_positive("steps", 3, integer=True)


def test_an_optional_setting_takes_none_and_says_so():
    check_positive("tol", None, optional=True)
    with pytest.raises(ValueError, match=r"^tol must be a positive finite number or None, got 0"):
        check_positive("tol", 0, optional=True)


SETTINGS: list[tuple[str, Callable[[object], object], bool]] = [
    ("Adaptive.rtol", lambda v: et_ode.Adaptive(rtol=v), False),
    ("Adaptive.atol", lambda v: et_ode.Adaptive(atol=v), False),
    ("Fixed.step_size", lambda v: et_ode.Fixed("rk4", v), False),
    ("EulerET.alpha", lambda v: et_ode.EulerET(alpha=v), False),
    ("EulerET.steps", lambda v: et_ode.EulerET(steps=v), True),
    ("SteadyState.tol", lambda v: et_ode.SteadyState(v), False),
    ("Integration.t1", lambda v: et_ode.Integration(t1=v), False),
    ("Integration.max_steps", lambda v: et_ode.Integration(max_steps=v), True),
    ("Implicit.max_iter", lambda v: et_ode.Implicit(max_iter=v), True),
    ("AttractorReadout.handoff", lambda v: et_ode.AttractorReadout(handoff=v), False),
    ("AttractorReadout.max_iter", lambda v: et_ode.AttractorReadout(max_iter=v), True),
    ("Adjoint.rtol", lambda v: et_ode.Adjoint(rtol=v), False),
]


@pytest.mark.parametrize(("name", "make", "integer"), SETTINGS, ids=[s[0] for s in SETTINGS])
def test_every_settings_object_refuses_zero_infinity_and_bools_by_name(name, make, integer):
    make(2 if integer else 0.5)  # a valid value builds
    for bad in (0, -1, True, math.inf) if not integer else (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="^" + re.escape(name) + " must be a positive"):
            make(bad)
