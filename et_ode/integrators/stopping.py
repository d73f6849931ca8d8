"""The stopping rule of :func:`et_ode.solve`: stop at the attractor, once a measure of motion falls below a tolerance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from et_ode.backend.validation import check_positive
from et_ode.dynamics.field import ETField
from et_ode.integrators.solution import Measure, Save

MEASURES: tuple[Measure, ...] = get_args(Measure)
_MEASURE_NAMES = {"dg_dt": "RMS |dg/dt|", "tangent_gradient": "RMS |T dE/dg|"}


@dataclass(frozen=True)
class SteadyState:
    """Stop once every sample's measure is below ``tol`` (or at the end of ``t``, whichever is first); gradients flow
    through the stopping time.

    Args:
        tol: the tolerance, positive and finite.
        measure: ``"dg_dt"`` (RMS of ``dg/dt``, :meth:`et_ode.ETField.rms_dg_dt`) or ``"tangent_gradient"`` (RMS of
            the energy gradient along the per-token spheres, ``T dE/dg``, :meth:`et_ode.ETField.rms_tangent_gradient`:
            scale-free, since ``|dg/dt|`` also shrinks as ``|x|`` drifts outward; see :mod:`et_ode.dynamics.manifold`;
            for a neuron of Euclidean geometry, ``dE/dg`` itself, without the directions its metric annihilates).
        per_sample: every sample stops at its own crossing and leaves the batch, so converged samples stop costing
            work (``stats.sample_evaluations``, ``stats.stop_times``); needs ``x0`` of shape ``(batch, N, D)`` and
            ``save="final"`` (:meth:`check`).

    Raises:
        ValueError: ``tol`` is not positive and finite, or ``measure`` is unknown.
        TypeError: ``per_sample`` is not a bool.
    """

    tol: float
    measure: Measure = "dg_dt"
    per_sample: bool = False

    def __post_init__(self) -> None:
        check_positive("SteadyState.tol", self.tol)
        if self.measure not in MEASURES:
            raise ValueError(f"SteadyState.measure must be one of {MEASURES}, got {self.measure!r}")
        if not isinstance(self.per_sample, bool):
            raise TypeError(f"SteadyState.per_sample must be a bool, got {self.per_sample!r}")

    @property
    def description(self) -> str:
        """What is tested, e.g. ``"RMS |dg/dt| < 0.001"``."""
        return f"{_MEASURE_NAMES[self.measure]} < {self.tol:g}"

    def check(self, x0: Tensor, save: Save) -> None:
        """Whether this stop can serve a solve from ``x0`` saving ``save``. An RMS is formed from squares, which lose
        their precision below the dtype's smallest normal number and then vanish, so nothing below its square root
        (1.1e-19 in float32, 1.5e-154 in float64) is told apart from 0.

        Args:
            x0: initial states ``(*batch, N, D)``.
            save: what the solve saves.

        Raises:
            ValueError: ``tol`` below what the measure resolves in ``x0``'s dtype (naming ``SteadyState.tol``), or
                ``per_sample=True`` without ``save="final"`` and ``x0`` of shape ``(batch, N, D)``.
        """
        floor = math.sqrt(torch.finfo(x0.dtype).tiny)
        if self.tol < floor:
            raise ValueError(
                f"SteadyState.tol={self.tol:g} is below what the measure resolves in x0's dtype {x0.dtype} "
                f"({floor:.3g}: an RMS of squares cannot tell smaller values from 0), so the stop could not be "
                f"met; use tol >= {floor:.3g}, or float64 (x0 and model)"
            )
        if self.per_sample and (save != "final" or x0.dim() != 3):
            raise ValueError(
                f"SteadyState(per_sample=True) needs save='final' and x0 of shape (batch, N, D); got "
                f"save={save!r}, x0 shape {tuple(x0.shape)}"
            )

    def rms(self, field: ETField, x: Tensor, velocity: Tensor) -> Tensor:
        """The measure per sample (the solver's hot path: unchecked, not counted).

        Args:
            field: the vector field.
            x: states ``(*batch, N, D)``.
            velocity: ``dx/dt`` already computed at ``x``, ``(*batch, N, D)``.

        Returns:
            The measure, ``(*batch,)``.
        """
        if self.measure == "dg_dt":
            return field.rms_dg_dt(x, velocity)
        return field.rms_tangent_gradient(x, velocity)


def within_tol(measure: Tensor, tol: float) -> Tensor:
    """Whether each ``measure`` ``(*batch,)`` is below ``tol`` up to the rounding of its dtype (a relative slack of
    ``max(1e-6, 64 eps)``: a state at rest in float32 can hold its measure a few rounding units above the ``tol`` its
    event search located), ``(*batch,)`` bool."""
    return measure < tol * (1 + max(1e-6, 64 * torch.finfo(measure.dtype).eps))
