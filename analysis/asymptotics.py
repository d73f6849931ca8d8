"""The asymptotic rate of approach to a minimum, predicted from the spectrum and measured on a solve.

Near a minimum ``g*`` the token scales grow linearly: ``d|xt_A|/dt = rho_A / tau`` with the outward force
``rho_A = -s_A . dE/dg_A`` (``s_A`` the unit radial direction), so ``sigma_A ~ rho_A t / (tau sqrt(D))`` and the
tangential rate ``gamma / (tau sigma_A)`` of token ``A`` becomes ``1 / (kappa_A t)`` with ``kappa_A = rho_A / r``,
``r = gamma sqrt(D)``. The linearised dynamics ``dw/dt = -(1/t) K^(-1) Hess_R w``, ``K = diag(kappa_A)``, is an
ordinary exponential approach in the intrinsic time ``log t``:

    |g(t) - g*| ~ t^(-p),      p = lambda_min(K^(-1/2) Hess_R K^(-1/2)).

:func:`predicted_exponent` computes ``p``; :func:`measured_exponent` solves from a start to a late time on a
log-spaced grid, finds ``g*`` from the final state and fits the power law of ``|g - g*|``;
:func:`plot_asymptotics` draws both against ``log t``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from et_ode import Adaptive, ETField, solve
from et_ode.manifold import radial_direction

from .convergence import RateFit, fit_decay
from .critical_points import newton_critical_point
from .plots import _finish
from .sphere import hessian_in_frame, unit_scale
from .stability import find_fixed_point

PathLike = str | os.PathLike[str]


@dataclass
class PredictedRate:
    """``exponent`` p, the outward forces ``rho`` ``(N,)``, ``kappa = rho / r`` ``(N,)`` and the eigenvalues of
    ``K^(-1/2) Hess_R K^(-1/2)`` (ascending, ``(N (D - 2),)``) at the minimum ``x`` ``(N, D)``."""

    exponent: float
    rho: Tensor
    kappa: Tensor
    eigenvalues: Tensor
    x: Tensor


def predicted_exponent(field: ETField, x_star: Tensor) -> PredictedRate:
    """``p = lambda_min(K^(-1/2) Hess_R K^(-1/2))`` at the critical point ``x_star`` ``(N, D)`` (a minimum for
    ``p > 0``). Raises ValueError when some token's outward force ``rho_A`` is not positive (then its scale does
    not grow and the power law does not apply)."""
    neuron = field.model.neuron
    x = unit_scale(x_star.detach(), neuron.eps)
    with torch.no_grad():
        g = neuron(x)
        s, radius = radial_direction(g, neuron.delta.detach())
        rho = -(s * field.dE_dg(g)).sum(dim=-1)  # (N,)
    if not bool((rho > 0).all()):
        raise ValueError(f"x_star has tokens with a non-positive outward force rho = {rho.tolist()}: no power law")
    kappa = rho / radius[..., 0]
    matrix, _, _ = hessian_in_frame(field, x)
    scale = kappa.repeat_interleave(x.shape[-1] - 2).rsqrt()  # frame vector A (D-2) + j lives on token A
    values = torch.linalg.eigvalsh(scale[:, None] * matrix * scale[None, :])
    return PredictedRate(exponent=float(values[0]), rho=rho, kappa=kappa, eigenvalues=values, x=x)


@dataclass
class MeasuredRate:
    """A solve's approach to its limit: saved times ``ts`` ``(T,)``, RMS ``|g - g*|`` ``distance`` ``(T,)``, the
    power-law fit over the late, log-time window, and the prediction at the limit ``g*``."""

    ts: Tensor
    distance: Tensor
    fit: RateFit
    predicted: PredictedRate

    @property
    def exponent(self) -> float:
        return self.fit.rate


def measured_exponent(field: ETField, x0: Tensor, *, t_end: float = 1e5, points: int = 61, tail: float = 0.3,
                      rtol: float = 1e-10, atol: float = 1e-12) -> MeasuredRate:
    """Solve from ``x0`` ``(N, D)`` to ``t_end`` on ``points`` log-spaced times, locate ``g*`` (descent, then
    Newton) from the final state, and fit ``|g - g*| ~ t^(-p)`` over the last ``tail`` of the span in log time."""
    if not (isinstance(x0, Tensor) and x0.dim() == 2 and x0.shape[-1] == field.model.dim):
        raise ValueError(f"x0 must be one state (N, D) with D={field.model.dim}, got "
                         f"{tuple(x0.shape) if isinstance(x0, Tensor) else type(x0).__name__}")
    if not (t_end > 1 and isinstance(points, int) and points >= 5):
        raise ValueError(f"t_end must be > 1 and points an integer >= 5, got t_end={t_end}, points={points}")
    grid = torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-2, math.log10(t_end), points - 1,
                                                                          dtype=torch.float64)])
    with torch.no_grad():
        solution = solve(field, x0.detach(), grid.to(x0.dtype), solver=Adaptive(rtol=rtol, atol=atol),
                         max_steps=1_000_000)
    limit = find_fixed_point(field, solution.x[None], tol=1e-9, max_iter=5000).x[0]
    point = newton_critical_point(field, limit)
    neuron = field.model.neuron
    with torch.no_grad():
        distance = (neuron(solution.xs) - neuron(point.x)).square().mean(dim=(-1, -2)).sqrt()
    _, power = fit_decay(grid, distance, tail=tail)
    return MeasuredRate(ts=grid, distance=distance.to(torch.float64).cpu(), fit=power,
                        predicted=predicted_exponent(field, point.x))


def plot_asymptotics(rates: list[MeasuredRate], *, labels: list[str] | None = None, path: PathLike | None = None,
                     figsize: tuple[float, float] = (8.0, 5.0), dpi: int = 100) -> Figure:
    """``|g - g*|`` against the intrinsic time ``log t`` (log scale: the power law is a straight line of slope
    ``-p``), with the predicted slope drawn through the last point of each."""
    labels = labels or [f"trajectory {i}" for i in range(len(rates))]
    if len(labels) != len(rates):
        raise ValueError(f"labels must have one entry per rate ({len(rates)}), got {len(labels)}")
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    for i, (rate, label) in enumerate(zip(rates, labels, strict=True)):
        keep = (rate.ts > 0) & (rate.distance > 0)
        log_t = rate.ts[keep].log().numpy()
        distance = rate.distance[keep].numpy()
        ax.plot(log_t, distance, "o", color=colors(i), markersize=3,
                label=f"{label}: measured p = {rate.exponent:.3f}")
        p = rate.predicted.exponent
        ax.plot(log_t, distance[-1] * np.exp(-p * (log_t - log_t[-1])), "-", color=colors(i), alpha=0.7,
                label=f"{label}: predicted p = {p:.3f}")
    ax.set(yscale="log", xlabel="intrinsic time log t", ylabel="RMS |g - g*| (log scale)",
           title="Approach to the minimum in intrinsic time: |g - g*| ~ t^(-p) = exp(-p log t)\n"
                 "p = lambda_min(K^(-1/2) Hess_R K^(-1/2)), K = diag(rho_A / r)")
    ax.set_ylim(bottom=max(min(float(r.distance[r.distance > 0].min()) for r in rates) / 3, 1e-14))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _finish(fig, path, dpi)
