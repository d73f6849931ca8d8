"""Convergence of ET trajectories: traces against time, convergence times, decay rates, zero-mode drift.

The attractor lives in ``g``-space (see the mathematics page), so convergence is measured there: RMS ``|dg/dt|``
(``dg/dt = M dx/dt``) and the tangential gradient RMS ``|T dE/dg|`` (see :mod:`et_ode.dynamics.manifold`): the
first falls like a power of ``t`` even far from a critical point, because the token scale ``sigma``
grows about linearly and slows the motion of ``g`` down; the second is scale-free and vanishes
exactly at a critical point on the spheres. ``|dx/dt|`` need not vanish at all: ``x`` drifts along
the all-ones vector of each token (exact zero mode of ``M``) and radially (the scale grows); both
drifts are reported separately. For a neuron of Euclidean geometry ``g`` does not drift: its tangential gradient is
``dE/dg`` itself (without the directions the metric annihilates), and the drifts are those of the token means and
scales of ``x``.

Shapes: a solution holds ``xs`` of shape ``(T, *batch, N, D)``; every per-sample quantity here is
flattened to ``B = prod(batch)`` samples (``B = 1`` without batch dimensions).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from et_ode import ETField, LayerNormNeuron, Solution
from et_ode.analysis._tables import Table, record
from et_ode.backend.validation import check_positive
from et_ode.energy.masks import Mask


def flat_states(solution: Solution) -> Tensor:
    """The saved states as ``(T, B, N, D)``; raises ValueError when the solution kept none."""
    if not isinstance(solution, Solution):
        raise TypeError(f"solution must be an et_ode.Solution, got {type(solution).__name__}")
    if solution.xs is None:
        raise ValueError("solution.xs is None: solve with save='all' or save='steps' to analyse a trajectory")
    xs = solution.xs.detach()
    dim = solution.field.model.dim
    if xs.dim() < 3 or xs.shape[-1] != dim:
        raise ValueError(f"solution.xs must have shape (T, *batch, N, D) with D={dim}, got {tuple(xs.shape)}")
    return xs.reshape(xs.shape[0], -1, *xs.shape[-2:])


def flat_mask(mask: Mask, batch_shape: tuple[int, ...]) -> Mask:
    """An ``(N, N)`` mask (or a GraphMask, shared by the batch) unchanged; a ``(*batch, N, N)`` one broadcast to
    ``batch_shape`` and flattened to ``(B, N, N)``."""
    if not isinstance(mask, Tensor) or mask.dim() == 2:
        return mask
    n = mask.shape[-1]
    return mask.expand(*batch_shape, n, n).reshape(-1, n, n)


def flat_field(solution: Solution) -> ETField:
    """The solution's field, its mask flattened like :func:`flat_states` (for the ``(T, B, N, D)`` states)."""
    field = solution.field
    return field.with_mask(flat_mask(field.mask, tuple(solution.x.shape[:-2])))


@dataclass
class ConvergenceTraces:
    """Per-sample quantities at the saved times.

    Attributes:
        ts: the saved times ``(T,)``.
        energy: the energy ``(T, B)``.
        rms_dg_dt: RMS ``|dg/dt|`` ``(T, B)``.
        rms_dx_dt: RMS ``|dx/dt|`` ``(T, B)``.
        rms_tangent_gradient: RMS ``|T dE/dg|`` ``(T, B)``.
        ones_drift: RMS over tokens of the change of the token mean ``mean_i x[A, i]`` since ``ts[0]`` (units of
            ``x``), ``(T, B)``.
        radial_drift: mean over tokens of the change of the token scale ``sigma_A`` (the RMS of the centered token)
            since ``ts[0]``, ``(T, B)``; it grows about linearly in ``t``.
    """

    ts: Tensor
    energy: Tensor
    rms_dg_dt: Tensor
    rms_dx_dt: Tensor
    rms_tangent_gradient: Tensor
    ones_drift: Tensor
    radial_drift: Tensor


def convergence_traces(solution: Solution) -> ConvergenceTraces:
    """Energy, RMS ``|dg/dt|``, RMS ``|dx/dt|``, RMS ``|T dE/dg|`` and both drifts at every saved time, from the
    solution's field (one evaluation of ``dE/dg`` per saved state).

    Args:
        solution: a solve's :class:`~et_ode.Solution` with its saved states ``(T, *batch, N, D)``.

    Returns:
        The :class:`ConvergenceTraces`, each trace ``(T, B)`` on the CPU (the batch flattened).

    Raises:
        TypeError: ``solution`` is not an :class:`~et_ode.Solution`.
        ValueError: the solution kept no states (``save="final"``).
    """
    xs = flat_states(solution)
    field = flat_field(solution)
    with torch.no_grad():
        velocity = field.velocity(xs)
        means = xs.mean(dim=-1)
        neuron = field.model.neuron
        eps = neuron.eps if isinstance(neuron, LayerNormNeuron) else 0.0
        scale = (xs - means[..., None]).square().mean(dim=-1).add(eps).sqrt()
        return ConvergenceTraces(
            ts=solution.ts.detach().to(torch.float64).cpu(),
            energy=field.energy(xs).cpu(),
            rms_dg_dt=field.rms_dg_dt(xs, velocity).cpu(),
            rms_dx_dt=velocity.square().mean(dim=(-1, -2)).sqrt().cpu(),
            rms_tangent_gradient=field.rms_tangent_gradient(xs, velocity).cpu(),
            ones_drift=(means - means[:1]).square().mean(dim=-1).sqrt().cpu(),
            radial_drift=(scale - scale[:1]).mean(dim=-1).cpu(),
        )


@dataclass
class RateFit:
    """A least-squares fit of ``log v`` near the end of a trajectory.

    Attributes:
        model: ``"exponential"`` (``v ~ prefactor * exp(-rate * t)``) or ``"power"`` (``v ~ prefactor * t^(-rate)``).
        rate: the fitted rate (``nan`` with fewer than 3 usable points).
        prefactor: the fitted prefactor.
        rms_log_residual: the RMS of the residual of ``log v`` (natural log) over the points used.
        points: the number of points used.
    """

    model: str
    rate: float
    prefactor: float
    rms_log_residual: float
    points: int


def fit_decay(ts: Tensor, values: Tensor, *, tail: float = 0.5, min_points: int = 5) -> tuple[RateFit, RateFit]:
    """Fit ``values`` (``(T,)``, positive) near the end, as an exponential and as a power law.

    The window is the last ``tail`` fraction of the span in **log time** (from the first positive saved time
    to the last), the intrinsic time of the ET flow, widened to at least ``min_points`` usable points (positive
    values, ``t > 0``): a linear-time window would keep only the last two points of a log-spaced grid.

    Args:
        ts: the times ``(T,)``.
        values: the decaying quantity ``(T,)``, positive.
        tail: the fraction of the span in log time to fit.
        min_points: the fewest usable points the window holds.

    Returns:
        ``(exponential, power)`` :class:`RateFit`s; both have ``nan`` rates when fewer than 3 usable points exist.
    """
    if not 0 < tail <= 1:
        raise ValueError(f"tail must be in (0, 1], got {tail!r}")
    t = ts.detach().to(torch.float64).cpu()
    v = values.detach().to(torch.float64).cpu()
    usable = (t > 0) & (v > 0) & torch.isfinite(v)
    t, logv = t[usable], v[usable].log()
    if len(t):
        log_t = t.log()
        start = float(log_t[-1]) - tail * float(log_t[-1] - log_t[0])
        keep = log_t >= start
        keep[-min(min_points, len(t)) :] = True
        t, logv = t[keep], logv[keep]
    fits = []
    for model, abscissa in (("exponential", t), ("power", t.log() if len(t) else t)):
        if len(t) < 3 or float(abscissa.max() - abscissa.min()) <= 0:
            fits.append(RateFit(model, math.nan, math.nan, math.nan, int(len(t))))
            continue
        design = torch.stack([torch.ones_like(abscissa), abscissa], dim=1)
        coef = torch.linalg.lstsq(design, logv[:, None]).solution[:, 0]
        residual = logv - design @ coef
        fits.append(
            RateFit(model, float(-coef[1]), float(coef[0].exp()), float(residual.square().mean().sqrt()), int(len(t)))
        )
    return fits[0], fits[1]


def first_time_below(ts: Tensor, values: Tensor, tol: float) -> float | None:
    """The first saved time from which ``values`` (``(T,)``) stays below ``tol`` to the end, or None."""
    above = (values >= tol).nonzero()
    if len(above) == 0:
        return float(ts[0])
    last = int(above[-1])
    return None if last == len(ts) - 1 else float(ts[last + 1])


@dataclass
class SampleConvergence:
    """Convergence summary of one sample (see :func:`analyze_convergence`).

    Attributes:
        sample: the sample's index in the batch.
        converged: RMS ``|dg/dt|`` ends below ``tol``.
        t_converged: the first saved time from which RMS ``|dg/dt|`` stays below ``tol``, or None.
        tangent_converged: RMS ``|T dE/dg|`` ends below ``tangent_tol``.
        t_tangent_converged: the first saved time from which it stays below ``tangent_tol``, or None.
        energy_start: the energy at the first saved time.
        energy_end: the energy at the last saved time.
        final_rms_dg_dt: RMS ``|dg/dt|`` at the last saved time.
        final_rms_dx_dt: RMS ``|dx/dt|`` at the last saved time.
        final_rms_tangent_gradient: RMS ``|T dE/dg|`` at the last saved time.
        exponential: the exponential fit of the decay of RMS ``|dg/dt|``.
        power: the power-law fit of the decay.
        better_fit: ``"exponential"`` or ``"power"`` (the smaller log residual), ``"n/a"`` when too few points.
        ones_drift: :attr:`ConvergenceTraces.ones_drift` at the last saved time.
        radial_drift: :attr:`ConvergenceTraces.radial_drift` at the last saved time.
    """

    sample: int
    converged: bool
    t_converged: float | None
    tangent_converged: bool
    t_tangent_converged: float | None
    energy_start: float
    energy_end: float
    final_rms_dg_dt: float
    final_rms_dx_dt: float
    final_rms_tangent_gradient: float
    exponential: RateFit
    power: RateFit
    better_fit: str
    ones_drift: float
    radial_drift: float


@dataclass
class ConvergenceReport(Table):
    """Traces and per-sample summaries of a solution's convergence.

    Attributes:
        traces: the per-sample quantities at the saved times.
        samples: one summary per sample.
        tol: the threshold on RMS ``|dg/dt|``.
        tangent_tol: the threshold on RMS ``|T dE/dg|``.
        tail: the fraction of the span in log time over which the decay is fitted.
    """

    traces: ConvergenceTraces
    samples: list[SampleConvergence]
    tol: float
    tangent_tol: float
    tail: float

    @property
    def all_converged(self) -> bool:
        return all(s.converged for s in self.samples)

    def as_dict(self) -> dict[str, Any]:
        return record(self, derived=("all_converged",), left_out=("traces",))

    def table(self) -> str:
        """A Markdown table, one row per sample."""
        rows = [
            "| sample | converged (RMS dg/dt < tol) at t | critical (RMS T dE/dg < tol) at t | E start -> end | "
            "final RMS dg/dt | final RMS T dE/dg | final RMS dx/dt | decay: exp rate / power exponent (better) | "
            "ones drift | radial drift |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in self.samples:
            when = lambda ok, t: f"yes, {t:.4g}" if ok else "no"  # noqa: E731
            rows.append(
                f"| {s.sample} | {when(s.converged, s.t_converged)} | {when(s.tangent_converged, s.t_tangent_converged)}"
                f" | {s.energy_start:.6g} -> {s.energy_end:.6g} | {s.final_rms_dg_dt:.3g}"
                f" | {s.final_rms_tangent_gradient:.3g}"
                f" | {s.final_rms_dx_dt:.3g} | {_decay_cell(s)}"
                f" | {s.ones_drift:.3g} | {s.radial_drift:.3g} |"
            )
        return "\n".join(rows)


def _decay_cell(s: SampleConvergence) -> str:
    if s.better_fit == "n/a":
        return f"too few saved times to fit ({s.power.points})"
    return f"{s.exponential.rate:.3g} / {s.power.rate:.3g} ({s.better_fit})"


def analyze_convergence(
    solution: Solution, *, tol: float = 1e-3, tangent_tol: float | None = None, tail: float = 0.5
) -> ConvergenceReport:
    """Whether and when each sample converged, and how fast.

    Args:
        solution: a solve with saved states (``save="all"`` or ``"steps"``); its field (and mask) is analysed.
        tol: convergence tolerance on RMS ``|dg/dt|`` (the motion of ``g``): converged from the first
            saved time after which it stays below ``tol``.
        tangent_tol: the same on RMS ``|T dE/dg|`` (distance from a critical point); default ``tol``.
        tail: fraction of the time span in log time, at the end, over which the decay of RMS ``|dg/dt|`` is
            fitted (exponential and power law; ``better_fit`` is the one with the smaller log residual).
    """
    check_positive("tol", tol)
    tangent_tol = tol if tangent_tol is None else tangent_tol
    check_positive("tangent_tol", tangent_tol)
    traces = convergence_traces(solution)
    samples = []
    for b in range(traces.energy.shape[1]):
        t_dg = first_time_below(traces.ts, traces.rms_dg_dt[:, b], tol)
        t_tg = first_time_below(traces.ts, traces.rms_tangent_gradient[:, b], tangent_tol)
        exponential, power = fit_decay(traces.ts, traces.rms_dg_dt[:, b], tail=tail)
        if math.isnan(exponential.rms_log_residual):
            better = "n/a"
            if b == 0:
                warnings.warn(
                    f"analyze_convergence: the solution saved {len(traces.ts)} times, too few to fit the "
                    f"decay (at least 3 with t > 0 are needed; the rates are nan): solve on a grid, e.g. "
                    f't=torch.linspace(0, t1, 61), or with save="steps"',
                    RuntimeWarning,
                    stacklevel=2,
                )
        else:
            better = "power" if power.rms_log_residual < exponential.rms_log_residual else "exponential"
        samples.append(
            SampleConvergence(
                sample=b,
                converged=t_dg is not None,
                t_converged=t_dg,
                tangent_converged=t_tg is not None,
                t_tangent_converged=t_tg,
                energy_start=float(traces.energy[0, b]),
                energy_end=float(traces.energy[-1, b]),
                final_rms_dg_dt=float(traces.rms_dg_dt[-1, b]),
                final_rms_dx_dt=float(traces.rms_dx_dt[-1, b]),
                final_rms_tangent_gradient=float(traces.rms_tangent_gradient[-1, b]),
                exponential=exponential,
                power=power,
                better_fit=better,
                ones_drift=float(traces.ones_drift[-1, b]),
                radial_drift=float(traces.radial_drift[-1, b]),
            )
        )
    return ConvergenceReport(traces=traces, samples=samples, tol=tol, tangent_tol=tangent_tol, tail=tail)
