"""One validator for the numeric settings of the library's objects: a ValueError that names the setting."""

from __future__ import annotations

import math


def check_positive(name: str, value: object, *, integer: bool = False, optional: bool = False) -> None:
    """``value`` is a positive finite number (a positive ``int`` when ``integer``; None allowed when ``optional``).

    A bool is never a number here.

    Raises:
        ValueError: ``value`` is anything else; the message names ``name`` (e.g. ``"Adjoint.rtol"``).
    """
    if optional and value is None:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (0 < value < math.inf):
        what = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
