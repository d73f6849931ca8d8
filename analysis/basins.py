"""Basins of attraction: which attractor the flow reaches from where, on a plane of initial states and from
random starts.

Every start is integrated with :func:`et_ode.solve` to ``t1`` and finished by descent and Newton on the
spheres (:mod:`et_ode.analysis.critical_points`), which identifies its limit modulo token permutations where
that is a symmetry. :func:`basin_map` colours a plane of initial states (a slice through three points, e.g.
two minima and the saddle between them) by the attractor reached and overlays the flow's streamlines on the
plane; :func:`attractor_census` counts the attractors reached from random starts, with Wilson score intervals.
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
from et_ode.analysis._tables import Table
from et_ode.analysis.chart import chart_for
from et_ode.analysis.critical_points import CriticalPoint, match_or_append, newton_critical_point, permutation_symmetric
from et_ode.analysis.plots import EnergySlice, _finish, energy_slice
from et_ode.analysis.stability import find_fixed_point

PathLike = str | os.PathLike[str]


def wilson_interval(successes: int, trials: int, *, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion.

    Args:
        successes: the successes, from 0 to ``trials``.
        trials: the trials, at least 1.
        z: the normal quantile (1.96: a 95% interval).

    Returns:
        The interval's ends ``(low, high)`` within ``[0, 1]``.

    Raises:
        ValueError: ``trials < 1`` or ``successes`` outside ``[0, trials]``.
    """
    if not (isinstance(trials, int) and trials >= 1 and 0 <= successes <= trials):
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got successes={successes}, trials={trials}")
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def limits(
    field: ETField, starts: Tensor, *, t1: float = 50.0, rtol: float = 1e-7, atol: float = 1e-9
) -> list[CriticalPoint]:
    """The critical point each start ``(S, N, D)`` flows to: :func:`et_ode.solve` to ``t1``, descent, Newton."""
    with torch.no_grad():
        ends = solve(
            field, starts.detach(), (0.0, t1), solver=Adaptive(rtol=rtol, atol=atol), save="final", max_steps=100_000
        ).x
    descended = find_fixed_point(field, ends, tol=1e-7, max_iter=5000).x
    return [newton_critical_point(field, x) for x in descended]


def label(
    field: ETField, points: list[CriticalPoint], attractors: list[CriticalPoint], *, match_tol: float = 1e-5
) -> list[int]:
    """The index in ``attractors`` of each point (appending new ones; ``-1`` for a search that did not converge)."""
    permutations = permutation_symmetric(field)
    labels = []
    for point in points:
        if not point.converged:
            labels.append(-1)
            continue
        labels.append(match_or_append(field, attractors, point, permutations=permutations, match_tol=match_tol))
    return labels


@dataclass
class AttractorCensus(Table):
    """The attractors reached from ``starts`` random starts.

    Attributes:
        attractors: the distinct attractors reached.
        counts: ``counts[i]`` starts reached ``attractors[i]``.
        starts: the number of random starts.
        failed: the starts that did not converge.
        intervals: ``intervals[i]``, the Wilson 95% interval of the frequency ``counts[i] / starts``.
    """

    attractors: list[CriticalPoint]
    counts: list[int]
    starts: int
    failed: int
    intervals: list[tuple[float, float]]

    def table(self) -> str:
        lines = [
            f"{self.starts} random starts followed to their limits ({self.failed} did not converge).",
            "",
            "| attractor | energy | kind | reached by | frequency | 95% interval (Wilson) |",
            "|---|---|---|---|---|---|",
        ]
        for i, (a, count, (low, high)) in enumerate(zip(self.attractors, self.counts, self.intervals, strict=True)):
            lines.append(
                f"| {i} | {a.energy:.6g} | {a.kind} | {count} | {count / self.starts:.3f} | [{low:.3f}, {high:.3f}] |"
            )
        return "\n".join(lines)


def attractor_census(
    field: ETField,
    starts: Tensor,
    *,
    t1: float = 50.0,
    match_tol: float = 1e-5,
    attractors: list[CriticalPoint] | None = None,
) -> AttractorCensus:
    """Follow every start to its limit and count the attractors reached (most frequent first).

    Args:
        field: the vector field.
        starts: start states ``(S, N, D)``.
        t1: the end time of each flow, before descent and Newton polish the limit.
        match_tol: the distance within which two limits are one attractor.
        attractors: attractors known beforehand (their order is the labels'), or None.

    Returns:
        The :class:`AttractorCensus`, with a Wilson interval per frequency.

    Raises:
        ValueError: ``starts`` is not a tensor ``(S, N, D)`` of the model's ``D``.
    """
    if not (isinstance(starts, Tensor) and starts.dim() == 3 and starts.shape[-1] == field.model.dim):
        raise ValueError(
            f"starts must be a tensor (S, N, D) with D={field.model.dim}, got "
            f"{tuple(starts.shape) if isinstance(starts, Tensor) else type(starts).__name__}"
        )
    known = list(attractors or [])
    labels = label(field, limits(field, starts, t1=t1), known, match_tol=match_tol)
    counts = [labels.count(i) for i in range(len(known))]
    order = sorted(range(len(known)), key=lambda i: -counts[i])
    order = [i for i in order if counts[i] > 0]
    total = len(labels)
    return AttractorCensus(
        attractors=[known[i] for i in order],
        counts=[counts[i] for i in order],
        starts=total,
        failed=labels.count(-1),
        intervals=[wilson_interval(counts[i], total) for i in order],
    )


@dataclass
class BasinMap:
    """The basins of attraction on a plane of initial states.

    Attributes:
        slice: the plane.
        grid: the coordinates ``(R,)`` along each of its axes ``a`` and ``b``.
        labels: the attractor (index into ``attractors``, ``-1``: not converged) reached from each point, ``(R, R)`` (row:
            coordinate ``b``, column: ``a``).
        attractors: the distinct limits.
        flow: ``(2, R, R)``, the components along ``u, v`` of the Riemannian descent direction ``-T dE/dg`` at each
            initial state (for streamlines).
    """

    slice: EnergySlice
    grid: Tensor
    labels: Tensor
    attractors: list[CriticalPoint]
    flow: Tensor


def basin_map(
    field: ETField,
    center: Tensor,
    through: Tensor,
    *,
    span: float | None = None,
    resolution: int = 15,
    t1: float = 50.0,
    attractors: list[CriticalPoint] | None = None,
    match_tol: float = 1e-5,
) -> BasinMap:
    """The plane through ``center`` ``(N, D)`` and the two states ``through`` ``(2, N, D)`` (e.g. a saddle and the
    two minima it joins), ``resolution`` x ``resolution`` initial states on it, each followed to its limit.

    Args:
        field: the vector field.
        center: the plane's center ``(N, D)``.
        through: two states ``(2, N, D)`` the plane passes through.
        span: half-width in ``g`` (default 1.3 times the farther of the two points).
        resolution: grid points per side.
        t1, attractors, match_tol: as in :func:`attractor_census`.

    Returns:
        The :class:`BasinMap`.
    """
    if not (isinstance(resolution, int) and resolution >= 2):
        raise ValueError(f"resolution must be an integer >= 2, got {resolution!r}")
    if not (isinstance(through, Tensor) and through.dim() == 3 and through.shape[0] == 2):
        raise ValueError(
            f"through must be a tensor (2, N, D), got "
            f"{tuple(through.shape) if isinstance(through, Tensor) else type(through).__name__}"
        )
    chart = chart_for(field)
    plane = energy_slice(field, center, trajectory=through)
    if span is None:
        assert plane.coords is not None  # energy_slice projects the trajectory it is given
        span = 1.3 * float(plane.coords.abs().max())
    grid = torch.linspace(-span, span, resolution, dtype=center.dtype, device=center.device)
    b, a = torch.meshgrid(grid, grid, indexing="ij")
    g = plane.points(a, b).reshape(-1, *center.shape)
    starts = chart.rescaled(chart.state(g))  # on the spheres token scale 1: the flow's pace
    known = list(attractors or [])
    labels = label(field, limits(field, starts, t1=t1), known, match_tol=match_tol)
    with torch.no_grad():
        descent = -field.tangent_gradient(starts)  # (R R, N, D)
    flow = torch.stack([(descent * plane.u).sum(dim=(-1, -2)), (descent * plane.v).sum(dim=(-1, -2))])
    return BasinMap(
        slice=plane,
        grid=grid.cpu(),
        labels=torch.tensor(labels).reshape(resolution, resolution),
        attractors=known,
        flow=flow.reshape(2, resolution, resolution).to(torch.float64).cpu(),
    )


def plot_basin_map(
    basins: BasinMap,
    *,
    marks: dict[str, Tensor] | None = None,
    path: PathLike | None = None,
    figsize: tuple[float, float] = (7.5, 6.5),
    dpi: int = 100,
) -> Figure:
    """The basin map: each initial state coloured by the attractor it reaches, the streamlines of the Riemannian
    descent direction projected on the plane, and optional marks.

    Args:
        basins: the :class:`BasinMap`.
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.
        marks: ``{name: state (N, D)}`` drawn at their coordinates, or None.

    Returns:
        The figure of the basins.
    """
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap

    grid = basins.grid.numpy()
    count = max(len(basins.attractors), 1)
    palette = colormaps["tab10"]
    cmap = ListedColormap(["lightgray"] + [palette(i % 10) for i in range(count)])
    norm = BoundaryNorm(np.arange(-1.5, count + 0.5), cmap.N)
    step = (grid[1] - grid[0]) / 2
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(
        basins.labels.numpy(),
        origin="lower",
        cmap=cmap,
        norm=norm,
        interpolation="nearest",
        extent=(grid[0] - step, grid[-1] + step, grid[0] - step, grid[-1] + step),
        alpha=0.75,
    )
    ax.streamplot(
        grid, grid, basins.flow[0].numpy(), basins.flow[1].numpy(), color="black", linewidth=0.7, density=1.0, arrowsize=0.8
    )
    colorbar = fig.colorbar(image, ax=ax, ticks=list(range(-1, count)))
    colorbar.ax.set_yticklabels(
        ["not converged"] + [f"{i}: E = {a.energy:.4g} ({a.kind})" for i, a in enumerate(basins.attractors)],
        fontsize="small",
    )
    plane = basins.slice
    for name, state in (marks or {}).items():
        with torch.no_grad():
            offset = chart_for(plane.field).coordinates(state) - plane.g_star
        ax.scatter(
            float((offset * plane.u).sum()),
            float((offset * plane.v).sum()),
            marker="*",
            s=180,
            color="white",
            edgecolors="black",
            zorder=5,
        )
        ax.annotate(
            name,
            (float((offset * plane.u).sum()), float((offset * plane.v).sum())),
            textcoords="offset points",
            xytext=(6, 6),
            fontsize="small",
        )
    ax.set(
        xlabel="coordinate along u (units of g)",
        ylabel="coordinate along v (units of g)",
        aspect="equal",
        title="Basins of attraction on a plane of initial states\n(colour: attractor reached; lines: descent direction)",
    )
    return _finish(fig, path, dpi)
