"""Spectra along trajectories: the Riemannian Hessian's extreme eigenvalues and saddle index against time,
and the full Lyapunov spectrum by the QR method.

The Hessian along a trajectory is the local curvature of ``E`` on the spheres at each saved ``g`` (a
critical point's classification only once the trajectory has arrived); its index (the number of negative
eigenvalues) tells when a trajectory passes near a saddle. The Lyapunov spectrum follows ``k`` orthonormal
tangent perturbations of ``g`` and re-orthonormalises them by QR after each span (Benettin et al.); with
``intrinsic=True`` it is measured on the :class:`~et_ode.analysis.sphere.FixedScaleField` (``sigma`` fixed,
tangential rates ``gamma / tau`` throughout), where at a critical point the exponents are exactly
``-(gamma / tau)`` times the eigenvalues of ``Hess_R``. A neuron of Euclidean geometry has them in its chart
(:mod:`et_ode.analysis.chart`): the Hessian of ``E(g(x))`` in ``x`` and the plain flow.

Shapes: states ``(N, D)`` (one sample) or ``(T, B, N, D)`` saved states; spectra ``(k,)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure
from torch import Tensor

from et_ode import ETField, Solution, solve
from et_ode.analysis.chart import chart_for
from et_ode.analysis.convergence import flat_field, flat_states
from et_ode.analysis.exponents import Benettin, checked_benettin
from et_ode.analysis.lyapunov import ANALYSIS_MAX_STEPS, bounded_odeint
from et_ode.analysis.plots import _finish, _log_time_axis, _sample_colors
from et_ode.backend.validation import check_positive

PathLike = str | os.PathLike[str]
#: the settings of :func:`lyapunov_spectrum` by default
SPECTRUM_BENETTIN = Benettin()


@dataclass
class HessianTrace:
    """The Riemannian Hessian's spectrum along a solution, per saved time and examined sample (``B`` of them).

    Attributes:
        ts: the saved times ``(T,)``.
        smallest: the smallest eigenvalue of ``Hess_R`` ``(T, B)``.
        largest: its largest eigenvalue ``(T, B)``.
        index: the number of eigenvalues below ``-zero_tol`` ``(T, B)``.
        rms_tangent_gradient: RMS ``|T dE/dg|`` ``(T, B)``.
        zero_tol: the size up to which an eigenvalue counts as zero.
    """

    ts: Tensor
    smallest: Tensor
    largest: Tensor
    index: Tensor
    rms_tangent_gradient: Tensor
    zero_tol: float


def hessian_along(solution: Solution, *, max_times: int = 25, max_samples: int = 10, zero_tol: float = 1e-8) -> HessianTrace:
    """The Riemannian Hessian's spectrum at (at most ``max_times``, evenly picked) saved states of ``solution``, for
    its first ``max_samples`` samples (the flattened batch).

    Dense: ``N (D - 2)`` Hessian-vector products per state and sample, meant for small systems.

    Args:
        solution: a solve with saved states ``(T, *batch, N, D)``.
        max_times: saved states examined at most.
        max_samples: samples examined at most.
        zero_tol: the relative size up to which an eigenvalue counts as zero (for the index).

    Returns:
        The :class:`HessianTrace`.
    """
    if not (isinstance(max_times, int) and max_times >= 2):
        raise ValueError(f"max_times must be an integer >= 2, got {max_times!r}")
    check_positive("max_samples", max_samples, integer=True)
    xs = flat_states(solution)
    field = flat_field(solution)
    picks = torch.linspace(0, xs.shape[0] - 1, min(max_times, xs.shape[0])).round().long().unique()
    rows_small, rows_large, rows_index, rows_rms = [], [], [], []
    for k in picks.tolist():
        small, large, index, rms = [], [], [], []
        for b in range(min(xs.shape[1], max_samples)):
            chart = chart_for(field.select(b))
            matrix, gradient, _ = chart.hessian_in_frame(chart.canonical(xs[k, b]))
            values = torch.linalg.eigvalsh(matrix)
            small.append(values[0])
            large.append(values[-1])
            index.append((values < -zero_tol).sum())
            rms.append(gradient.square().sum().sqrt() / xs[k, b].numel() ** 0.5)
        rows_small.append(torch.stack(small))
        rows_large.append(torch.stack(large))
        rows_index.append(torch.stack(index))
        rows_rms.append(torch.stack(rms))
    return HessianTrace(
        ts=solution.ts.detach().to(torch.float64).cpu()[picks],
        smallest=torch.stack(rows_small).cpu(),
        largest=torch.stack(rows_large).cpu(),
        index=torch.stack(rows_index).cpu(),
        rms_tangent_gradient=torch.stack(rows_rms).cpu(),
        zero_tol=zero_tol,
    )


@dataclass
class LyapunovSpectrum:
    """The ``k`` largest Lyapunov exponents (descending) of one trajectory, per unit time of the flow, measured
    in ``g``.

    Attributes:
        exponents: the exponents over ``[0, t1]`` ``(k,)``.
        late: the exponents over its second half ``(k,)`` (the start's transient discarded).
        times: the renormalisation times ``(K,)``.
        running: the running estimates at ``times`` ``(K, k)``.
        intrinsic: the exponents are of the fixed-scale flow from the limit spheres (False: of the plain solve).
        d0: the perturbations' size in ``g``.
    """

    exponents: Tensor
    late: Tensor
    times: Tensor
    running: Tensor
    intrinsic: bool
    d0: float


def lyapunov_spectrum(
    field: ETField,
    x0: Tensor,
    *,
    benettin: Benettin = SPECTRUM_BENETTIN,
    count: int | None = None,
    intrinsic: bool = True,
    max_steps: int = ANALYSIS_MAX_STEPS,
) -> LyapunovSpectrum:
    """The Lyapunov spectrum of the trajectory from ``x0`` ``(N, D)`` by the QR method.

    ``count`` tangent perturbations of ``g`` (default: all ``N (D - 2)``) of size ``d0`` are integrated with
    the reference state in one batch; after each of the ``renormalizations`` equal spans of ``[0, t1]`` (the
    settings of :class:`~et_ode.analysis.exponents.Benettin`) their g-differences, projected on the tangent space,
    are QR-factorised, ``log |R_ii| / d0`` accumulated and the perturbations reset to ``d0 Q``.

    Args:
        field: the vector field.
        x0: the reference state ``(N, D)``.
        benettin: the spans (at least 2), the perturbations' size and seed, and the solver.
        count: the number of exponents (default: all ``N (D - 2)``).
        intrinsic: follow the fixed-scale flow from the limit spheres (see :mod:`et_ode.analysis.sphere`) instead
            of the plain solve, whose rates decay like ``1 / t``.
        max_steps: the step budget of each span's integration.

    Returns:
        The :class:`LyapunovSpectrum`, ``count`` exponents in descending order.

    Raises:
        ValueError: ``x0`` is not one state, ``count`` out of range, or fewer than 2 renormalizations.
        TypeError: ``benettin`` is not a :class:`~et_ode.analysis.exponents.Benettin`.
        et_ode.SolveError: a span needs more than ``max_steps`` steps.
    """
    check_positive("max_steps", max_steps, integer=True)
    if not (isinstance(x0, Tensor) and x0.dim() == 2 and x0.shape[-1] == field.model.dim):
        raise ValueError(
            f"x0 must be one state (N, D) with D={field.model.dim}, got "
            f"{tuple(x0.shape) if isinstance(x0, Tensor) else type(x0).__name__}"
        )
    benettin = checked_benettin(benettin)
    t1, renormalizations, d0 = benettin.t1, benettin.renormalizations, benettin.d0
    if renormalizations < 2:
        raise ValueError(f"benettin.renormalizations must be at least 2 for a spectrum, got {renormalizations}")
    chart = chart_for(field)
    x = chart.canonical(x0.detach()) if intrinsic else x0.detach()
    dimension = chart.dimension(x.shape[0])
    count = dimension if count is None else count
    if not (isinstance(count, int) and 1 <= count <= dimension):
        raise ValueError(f"count must be an integer in [1, {dimension}], got {count!r}")
    generator = torch.Generator().manual_seed(benettin.seed)
    solver = benettin.solver
    frame = chart.frame(x).flatten(1)  # (n, N D)
    mixing = torch.randn(count, dimension, generator=generator, dtype=x.dtype).to(x.device)
    q = torch.linalg.qr((mixing @ frame).T).Q.T.reshape(count, *x.shape)  # (k, N, D) orthonormal coordinate directions
    fixed_scale = chart.steady_field()
    span = t1 / renormalizations
    grid = torch.tensor([0.0, span], dtype=x.dtype, device=x.device)
    total = torch.zeros(count, dtype=torch.float64)
    running = []
    with torch.no_grad():
        for _ in range(renormalizations):
            batch = torch.cat([x[None], x + chart.displacement(x, d0 * q)])  # on the spheres dx = sigma / gamma dg
            if intrinsic:
                batch = bounded_odeint(
                    fixed_scale,
                    batch,
                    grid,
                    method=solver.method,
                    rtol=solver.rtol,
                    atol=solver.atol,
                    what="lyapunov_spectrum (intrinsic)",
                    max_steps=max_steps,
                )[-1]
            else:
                batch = solve(field, batch, (0.0, span), solver=solver, save="final", max_steps=max_steps).x
            x = batch[0]
            g = chart.coordinates(batch)
            differences = chart.projector(x[None])(g[1:] - g[0]).flatten(1)  # (k, N D)
            q_new, r = torch.linalg.qr(differences.T)
            diagonal = r.diagonal()
            total += (diagonal.abs() / d0).log().to(torch.float64).cpu()
            running.append(total.clone())
            q = (q_new * diagonal.sign()).T.reshape(count, *x.shape)
    times = torch.arange(1, renormalizations + 1, dtype=torch.float64) * span
    running_tensor = torch.stack(running)
    half = renormalizations // 2 - 1
    late = (total - running_tensor[half]) / (t1 - float(times[half]))
    order = torch.argsort(late, descending=True)
    return LyapunovSpectrum(
        exponents=(total / t1)[order],
        late=late[order],
        times=times,
        running=(running_tensor / times[:, None])[:, order],
        intrinsic=intrinsic,
        d0=d0,
    )


def plot_hessian_along(
    trace: HessianTrace,
    *,
    path: PathLike | None = None,
    figsize: tuple[float, float] = (12.0, 4.5),
    dpi: int = 100,
) -> Figure:
    """The Riemannian Hessian's smallest and largest eigenvalue (left) and the saddle index (right) against time
    (log scale from the first positive saved time), one colour per sample of the trace.

    Args:
        trace: the :class:`HessianTrace` (:func:`hessian_along`).
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.

    Returns:
        The figure of the spectra.
    """
    count = trace.smallest.shape[1]
    colors = _sample_colors(count)
    t = trace.ts.numpy()
    positive = t > 0
    fig = Figure(figsize=figsize, layout="constrained")
    ax_values, ax_index = fig.subplots(1, 2)
    for b in range(count):
        ax_values.plot(t[positive], trace.smallest[positive, b].numpy(), color=colors[b], label=f"sample {b}: smallest")
        ax_values.plot(
            t[positive], trace.largest[positive, b].numpy(), color=colors[b], linestyle=":", label=f"sample {b}: largest"
        )
        ax_index.step(
            t[positive], trace.index[positive, b].numpy() + 0.04 * b, where="post", color=colors[b], label=f"sample {b}"
        )
    ax_values.axhline(0.0, color="black", linewidth=0.8)
    ax_values.set(
        ylabel="eigenvalue of Hess_R",
        title="Curvature of E on the spheres along the trajectory\nsolid: smallest, dotted: largest eigenvalue",
    )
    ax_index.set(
        ylabel="negative eigenvalues (saddle index)",
        title="Saddle index along the trajectory\n(0 once it is in a minimum's convex neighbourhood)",
    )
    for ax in (ax_values, ax_index):
        _log_time_axis(ax)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return _finish(fig, path, dpi)
