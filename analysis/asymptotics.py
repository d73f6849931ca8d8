"""The asymptotic rate of approach to a minimum, predicted from the spectrum and measured on a solve.

Near a minimum ``g*`` the token scales grow linearly: ``d|xt_A|/dt = rho_A / tau`` with the outward force
``rho_A = -s_A . dE/dg_A`` (``s_A`` the unit radial direction), so ``sigma_A ~ rho_A t / (tau sqrt(D))`` and the
tangential rate ``gamma / (tau sigma_A)`` of token ``A`` becomes ``1 / (kappa_A t)`` with ``kappa_A = rho_A / r``,
``r = gamma sqrt(D)``. The linearised dynamics ``dw/dt = -(1/t) K^(-1) Hess_R w``, ``K = diag(kappa_A)``, is an
ordinary exponential approach in the intrinsic time ``log t``:

    |g(t) - g*| ~ t^(-p),      p = lambda_min(K^(-1/2) Hess_R K^(-1/2)),
    RMS |dg/dt| ~ t^(-(p + 1))  (the tangential speed is the distance times the rate 1 / (kappa t)).

(The O(eps) radial motion of ``g`` adds ``~ t^(-2)`` to the distance and ``~ t^(-3)`` to the speed, below both
power laws for ``p < 1`` and below rounding at any ``p`` once ``eps / sigma^2`` is.)

The power law holds only in the asymptotic regime: once ``g`` is close enough to ``g*`` for the linearisation,
the faster modes have died out and the token scales have forgotten the transient (``|xt_A| = rho_A t / tau``,
which a long stay near a saddle can postpone to ``t ~ 1e20`` and beyond). Before that, the local slope
``-d log|g - g*| / d log t`` at a fixed ``t1`` is not an estimate of ``p``.

:func:`predicted_exponent` computes ``p``; :func:`measured_exponent` solves from a start to a late time on a
log-spaced grid, locates ``g*`` on the flow's limit spheres, detects whether (and from when) the regime is reached,
and fits the power laws of ``|g - g*|`` and RMS ``|dg/dt|`` over that window only; :func:`plot_asymptotics`
draws both against ``log t``.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from et_ode import Adaptive, ETField, find_attractor, solve
from et_ode.analysis.convergence import RateFit, fit_decay
from et_ode.analysis.plots import _finish
from et_ode.analysis.sphere import hessian_in_frame
from et_ode.backend.validation import check_positive
from et_ode.dynamics.manifold import radial_direction, to_limit_spheres
from et_ode.energy.neurons import sphere_neuron

PathLike = str | os.PathLike[str]


@dataclass
class PredictedRate:
    """The predicted power-law exponent of the approach to a minimum.

    Attributes:
        exponent: ``p``, the smallest eigenvalue of ``K^(-1/2) Hess_R K^(-1/2)``.
        rho: the tokens' outward forces ``(N,)``.
        kappa: ``rho / r`` ``(N,)``.
        eigenvalues: the eigenvalues of ``K^(-1/2) Hess_R K^(-1/2)`` ``(N (D - 2),)``, ascending.
        x: the minimum ``(N, D)``.
    """

    exponent: float
    rho: Tensor
    kappa: Tensor
    eigenvalues: Tensor
    x: Tensor


def predicted_exponent(field: ETField, x_star: Tensor) -> PredictedRate:
    """``p = lambda_min(K^(-1/2) Hess_R K^(-1/2))`` at a critical point (a minimum for ``p > 0``).

    Args:
        field: the vector field (LayerNorm neuron).
        x_star: the critical point ``(N, D)``.

    Returns:
        The :class:`PredictedRate`.

    Raises:
        ValueError: some token's outward force ``rho_A`` is not positive (its scale does not grow and the power
            law does not apply), or the neuron is not LayerNorm (the power law is the spheres': a Euclidean
            neuron's flow approaches its minima exponentially).
    """
    neuron = sphere_neuron(field.model.neuron, "the asymptotic exponent")
    x = to_limit_spheres(x_star.detach(), neuron.eps)
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
    """A solve's approach to its limit ``g*``.

    Attributes:
        ts: saved times ``(T,)`` (``ts[0] = 0``, then log-spaced).
        distance: RMS ``|g - g*|`` at the saved times ``(T,)``.
        speed: RMS ``|dg/dt|`` at the saved times ``(T,)``.
        local_slope: ``-d log|g - g*| / d log t`` between consecutive saved times ``(T - 1,)`` (nan where a
            distance is not above the floor or ``t = 0``).
        scale_error: ``max_A | |xt_A| tau / (rho*_A t) - 1 |`` at the saved times ``(T,)`` (nan at ``t = 0``):
            how far the token scales are from their asymptotic growth.
        fit: the power law of ``distance`` over ``window`` when ``asymptotic``, else over the last ``tail`` of the
            span in log time (a local slope, not an estimate of ``p``).
        speed_fit: the power law of ``speed`` over the same saved times (rate ``p + 1`` in the regime).
        predicted: the prediction at the limit ``g*``.
        window: saved-time indices ``(first, last)`` of the asymptotic window, or None.
        asymptotic: the regime is reached (see :func:`measured_exponent`).
        reason: why it is or is not, in words.
    """

    ts: Tensor
    distance: Tensor
    speed: Tensor
    local_slope: Tensor
    scale_error: Tensor
    fit: RateFit
    speed_fit: RateFit
    predicted: PredictedRate
    window: tuple[int, int] | None
    asymptotic: bool
    reason: str

    @property
    def exponent(self) -> float:
        """The fitted exponent of ``|g - g*|``: an estimate of ``p`` when ``asymptotic``, a local slope otherwise."""
        return self.fit.rate


@dataclass(frozen=True)
class RegimeTests:
    """The tests of the asymptotic regime in :func:`measured_exponent`.

    The regime is reached when a tail of the saved times spanning at least ``min_decades`` decades of ``t``
    (distances above ``floor``, the solve's accuracy) has (1) local slopes ``-d log|g - g*| / d log t`` within
    ``slope_tol`` (relative) of their median, (2) token scales within ``scale_tol`` of their asymptotic growth
    ``|xt_A| = rho*_A t / tau``, and (3) a power-law fit within ``agree_tol`` of the exponent predicted at the
    limit. Where it is not, the last ``tail`` of the span in log time is fitted.

    Attributes:
        slope_tol, scale_tol, agree_tol: the three tests, relative.
        min_decades: the decades of ``t`` the asymptotic tail must span.
        floor: distances below it (the solve's accuracy) are not used.
        tail: the fraction of the span (in log time) fitted when the regime is not found, in ``(0, 1]``.

    Raises:
        ValueError: a setting is not a positive number, or ``tail`` is above 1.
    """

    slope_tol: float = 0.01
    scale_tol: float = 0.01
    agree_tol: float = 0.01
    min_decades: float = 1.0
    floor: float = 1e-9
    tail: float = 0.3

    def __post_init__(self) -> None:
        for name in ("slope_tol", "scale_tol", "agree_tol", "min_decades", "floor", "tail"):
            check_positive(f"RegimeTests.{name}", getattr(self, name))
        if self.tail > 1:
            raise ValueError(f"RegimeTests.tail must be in (0, 1], got {self.tail!r}")


def _tail_window(
    log_t: np.ndarray, slopes: np.ndarray, scale_error: np.ndarray, distance: np.ndarray, tests: RegimeTests
) -> tuple[int, int, str]:
    """The longest tail ``[first, last]`` of saved times (``last``: the last distance above the floor) over which
    the local slopes stay within ``tests.slope_tol`` (relative) of their median and the scales within
    ``tests.scale_tol``;
    with the reason the window could not be extended further back."""
    above = np.nonzero(distance > tests.floor)[0]
    last = int(above[-1]) if len(above) else 0
    first, why = last, "no saved distance above the floor"
    while first > 1:  # (index 0 is t = 0)
        candidate = first - 1
        if not distance[candidate] > tests.floor:
            why = f"RMS |g - g*| <= {tests.floor:g} before t = {math.exp(log_t[candidate + 1]):.3g}"
            break
        if not scale_error[candidate] <= tests.scale_tol:
            why = (
                f"the token scales are off their asymptotic growth rho*_A t / tau by {scale_error[candidate]:.2g} "
                f"at t = {math.exp(log_t[candidate]):.3g}"
            )
            break
        window = slopes[candidate:last]
        median = float(np.median(window))
        if not (median > 0 and float(np.abs(window - median).max()) <= tests.slope_tol * median):
            why = (
                f"the local slope varies ({window.min():.4g} .. {window.max():.4g}) from t = "
                f"{math.exp(log_t[candidate]):.3g}"
            )
            break
        first = candidate
    return first, last, why


def _regime(
    ts: Tensor, distance: Tensor, speed: Tensor, scale_error: Tensor, predicted: float, tests: RegimeTests
) -> tuple[RateFit, RateFit, tuple[int, int] | None, bool, str, Tensor]:
    """The asymptotic window (if any), the fits over it (or over the last ``tests.tail``), and the reason."""
    log_t = ts.clamp_min(torch.finfo(torch.float64).tiny).log().numpy()
    log_d = distance.clamp_min(torch.finfo(torch.float64).tiny).log().numpy()
    slopes = -(log_d[1:] - log_d[:-1]) / (log_t[1:] - log_t[:-1])
    usable = (distance[:-1] > tests.floor).numpy() & (distance[1:] > tests.floor).numpy() & (ts[:-1] > 0).numpy()
    slopes = np.where(usable, slopes, np.nan)
    first, last, why = _tail_window(log_t, slopes, scale_error.numpy(), distance.numpy(), tests)
    decades = (log_t[last] - log_t[first]) / math.log(10) if last > first else 0.0
    if decades >= tests.min_decades:
        keep = slice(first, last + 1)
        fit = fit_decay(ts[keep], distance[keep], tail=1.0)[1]
        speed_fit = fit_decay(ts[keep], speed[keep], tail=1.0)[1]
        window = (first, last)
        span = f"t in [{float(ts[first]):.3g}, {float(ts[last]):.3g}]"
        if abs(fit.rate - predicted) <= tests.agree_tol * predicted:
            reason = (
                f"reached over {span}: local slope constant within {tests.slope_tol:g}, token scales within "
                f"{tests.scale_tol:g} of rho*_A t / tau, fitted p = {fit.rate:.5g} against {predicted:.5g} predicted"
            )
            return fit, speed_fit, window, True, reason, torch.from_numpy(slopes)
        reason = (
            f"not reached: over {span} the local slope is constant at {fit.rate:.5g}, but the prediction at "
            f"the limit is {predicted:.5g} (a slower transient, e.g. the next mode)"
        )
    else:
        reason = (
            f"not reached: the tail with a constant local slope and settled token scales spans "
            f"{decades:.2g} decade(s) of t, fewer than {tests.min_decades:g} ({why})"
        )
    fit = fit_decay(ts, distance, tail=tests.tail)[1]
    speed_fit = fit_decay(ts, speed, tail=tests.tail)[1]
    return fit, speed_fit, None, False, reason, torch.from_numpy(slopes)


def measured_exponent(
    field: ETField,
    x0: Tensor,
    *,
    t1: float = 1e5,
    points: int = 61,
    rtol: float = 1e-10,
    atol: float = 1e-12,
    tests: RegimeTests = RegimeTests(),
    strict: bool = False,
) -> MeasuredRate:
    """Solve from ``x0`` ``(N, D)`` to ``t1`` on ``points`` log-spaced times, locate ``g*`` on the flow's
    limit spheres (:func:`et_ode.find_attractor` from the final state, no flow phase), and measure the approach.

    Where the asymptotic regime is reached (the :class:`RegimeTests`), the fits of ``|g - g*|`` and RMS ``|dg/dt|``
    use its tail only. Otherwise the result says why (``asymptotic=False``, ``reason``), fits the last ``tail`` of
    the span in log time, and warns (RuntimeWarning), or raises ValueError with ``strict=True``.

    Args:
        field: the vector field (LayerNorm neuron).
        x0: the start ``(N, D)``.
        t1: the end time.
        points: the log-spaced saved times.
        rtol, atol: the solve's tolerances.
        tests: the tests of the asymptotic regime, and the fallback fit's ``tail``.
        strict: raise instead of warning when the regime is not reached.

    Returns:
        The :class:`MeasuredRate`.

    Raises:
        ValueError: bad arguments; the limit is not a minimum on the spheres (some ``rho_A <= 0``); with
            ``strict``, the asymptotic regime not reached.
        TypeError: ``tests`` is not a :class:`RegimeTests`.
    """
    if not (isinstance(x0, Tensor) and x0.dim() == 2 and x0.shape[-1] == field.model.dim):
        raise ValueError(
            f"x0 must be one state (N, D) with D={field.model.dim}, got "
            f"{tuple(x0.shape) if isinstance(x0, Tensor) else type(x0).__name__}"
        )
    sphere_neuron(field.model.neuron, "the asymptotic exponent")
    if isinstance(t1, bool) or not (isinstance(t1, (int, float)) and 1 < t1 < math.inf):
        raise ValueError(f"t1 must be a finite number > 1, got {t1!r}")
    if isinstance(points, bool) or not (isinstance(points, int) and points >= 5):
        raise ValueError(f"points must be an integer >= 5, got {points!r}")
    if not isinstance(tests, RegimeTests):
        raise TypeError(f"tests must be a RegimeTests(...), got {type(tests).__name__}")
    grid = torch.cat(
        [torch.zeros(1, dtype=torch.float64), torch.logspace(-2, math.log10(t1), points - 1, dtype=torch.float64)]
    )
    with torch.no_grad():
        solution = solve(field, x0.detach(), grid.to(x0.dtype), solver=Adaptive(rtol=rtol, atol=atol), max_steps=1_000_000)
    limit = find_attractor(field, solution.x.detach()[None], tol=1e-12, flow=False)
    predicted = predicted_exponent(field, limit.x[0])
    neuron = field.model.neuron
    assert solution.xs is not None  # save="all" (the default) keeps the states at the saved times
    with torch.no_grad():
        xs = solution.xs.detach()
        distance = (neuron(xs) - limit.g.detach()).square().mean(dim=(-1, -2)).sqrt().to(torch.float64).cpu()
        speed = field.rms_dg_dt(xs, field.velocity(xs)).to(torch.float64).cpu()
        length = (xs - xs.mean(dim=-1, keepdim=True)).norm(dim=-1).to(torch.float64).cpu()  # (T, N)
    ts = grid.cpu()
    growth = predicted.rho.to(torch.float64).cpu() * ts[:, None] / field.tau
    scale_error = torch.where(ts[:, None] > 0, (length / growth.clamp_min(1e-300) - 1).abs(), math.nan).amax(dim=-1)
    fit, speed_fit, window, asymptotic, reason, slopes = _regime(ts, distance, speed, scale_error, predicted.exponent, tests)
    if not asymptotic:
        message = f"measured_exponent: the asymptotic regime is {reason}; the fitted exponent is not an estimate of p"
        if strict:
            raise ValueError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return MeasuredRate(
        ts=ts,
        distance=distance,
        speed=speed,
        local_slope=slopes,
        scale_error=scale_error,
        fit=fit,
        speed_fit=speed_fit,
        predicted=predicted,
        window=window,
        asymptotic=asymptotic,
        reason=reason,
    )


def plot_asymptotics(
    rates: list[MeasuredRate],
    *,
    labels: list[str] | None = None,
    path: PathLike | None = None,
    figsize: tuple[float, float] = (8.0, 5.0),
    dpi: int = 100,
) -> Figure:
    """``|g - g*|`` against the intrinsic time ``log t`` (log scale: the power law is a straight line of slope
    ``-p``), with the predicted slope drawn through the last point of each and the asymptotic window shaded.

    Args:
        rates: the measurements (:func:`measured_exponent`).
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.
        labels: one legend entry per rate, or None.

    Returns:
        The figure of the approaches.
    """
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
        measured = (
            f"measured p = {rate.exponent:.3f}"
            if rate.asymptotic
            else f"local slope {rate.exponent:.3f} (asymptotic regime not reached)"
        )
        ax.plot(log_t, distance, "o", color=colors(i), markersize=3, label=f"{label}: {measured}")
        if rate.window is not None:
            first, last = rate.window
            ax.axvspan(math.log(float(rate.ts[first])), math.log(float(rate.ts[last])), color=colors(i), alpha=0.08)
        p = rate.predicted.exponent
        ax.plot(
            log_t,
            distance[-1] * np.exp(-p * (log_t - log_t[-1])),
            "-",
            color=colors(i),
            alpha=0.7,
            label=f"{label}: predicted p = {p:.3f}",
        )
    ax.set(
        yscale="log",
        xlabel="intrinsic time log t",
        ylabel="RMS |g - g*| (log scale)",
        title="Approach to the minimum in intrinsic time: |g - g*| ~ t^(-p) = exp(-p log t)\n"
        "p = lambda_min(K^(-1/2) Hess_R K^(-1/2)), K = diag(rho_A / r)",
    )
    ax.set_ylim(bottom=max(min(float(r.distance[r.distance > 0].min()) for r in rates) / 3, 1e-14))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _finish(fig, path, dpi)
