"""Pictures of ET dynamics. Every function returns a matplotlib ``Figure`` (Agg, no pyplot state) and,
given ``path``, writes it as a PNG of ``figsize * dpi`` pixels (width x height).

Conventions: time is in the units of the solve (``tau`` included); ``g`` is the normalized token.
States are ``(T, *batch, N, D)`` as in :class:`et_ode.Solution`; ``sample`` picks one sample of a batch
(flattened index).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from matplotlib.collections import LineCollection
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from torch import Tensor

from et_ode import Adaptive, EnergyAttention, ETField, Solution, solve
from et_ode.analysis.chart import SphereChart, chart_for
from et_ode.analysis.convergence import convergence_traces, flat_field, flat_states
from et_ode.backend.validation import check_positive

PathLike = str | os.PathLike[str]


def _finish(fig: Figure, path: PathLike | None, dpi: int) -> Figure:
    if path is not None:
        path = Path(path)
        if path.suffix.lower() != ".png":
            raise ValueError(f"path must end in .png, got {str(path)!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi, format="png")
    return fig


def readable_log_axis(axis: Any, *, most: int = 5) -> None:
    """Label a log-scaled matplotlib ``axis`` (``ax.xaxis`` or ``ax.yaxis``) with at most ``most`` major ticks, in
    scientific notation, and no labels on minor ticks (matplotlib labels those on a span under about a decade, where
    they overlap). A span that shows fewer than two powers of ten gets majors at 1, 2 and 5 times the powers."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter

    axis.axes.autoscale_view()
    low, high = sorted(axis.get_view_interval())
    powers = math.floor(math.log10(high)) - math.ceil(math.log10(low)) + 1 if low > 0 else 2  # powers of ten shown
    narrow = powers < 2
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if narrow else (1.0,), numticks=most + 1))
    # every major tick labelled (matplotlib would keep only the powers of ten on spans over a decade)
    axis.set_major_formatter(LogFormatterSciNotation(base=10, labelOnlyBase=False, minor_thresholds=(math.inf, math.inf)))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10)), numticks=12))
    axis.set_minor_formatter(NullFormatter())


def _log_time_axis(ax: Any) -> None:
    """The x-axis of ``ax`` as the time ``t`` on a log scale, labelled so, with :func:`readable_log_axis`'s ticks (call
    it once the data is drawn)."""
    ax.set(xscale="log", xlabel="time t (log scale)")
    readable_log_axis(ax.xaxis)


def _sample_index(sample: int, count: int) -> int:
    if not isinstance(sample, int) or not -count <= sample < count:
        raise ValueError(f"sample must be an integer index in [0, {count}), got {sample!r}")
    return sample % count


def _sample_colors(count: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if count <= 10 else "viridis"]
    return [cmap(i if count <= 10 else i / max(count - 1, 1)) for i in range(count)]


def plot_convergence(
    solution: Solution,
    *,
    max_samples: int = 10,
    path: PathLike | None = None,
    figsize: tuple[float, float] = (15.0, 4.5),
    dpi: int = 100,
) -> Figure:
    """Energy, RMS ``|dg/dt|`` and RMS ``|T dE/dg|`` (log-log), and the two zero-mode drifts of ``x``
    against time, one color per sample.

    Args:
        solution: a solve with saved states ``(T, *batch, N, D)``.
        max_samples: samples drawn at most.
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.

    Returns:
        The matplotlib ``Figure``.
    """
    traces = convergence_traces(solution)
    count = min(traces.energy.shape[1], max_samples)
    colors = _sample_colors(count)
    t = traces.ts.numpy()
    positive = t > 0
    fig = Figure(figsize=figsize, layout="constrained")
    ax_e, ax_r, ax_d = fig.subplots(1, 3)
    for b in range(count):
        label = f"sample {b}"
        ax_e.plot(t, traces.energy[:, b].numpy(), color=colors[b], label=label)
        ax_r.plot(t[positive], traces.rms_dg_dt[positive, b].numpy(), color=colors[b], label=f"{label}: RMS |dg/dt|")
        ax_r.plot(
            t[positive],
            traces.rms_tangent_gradient[positive, b].numpy(),
            color=colors[b],
            linestyle="--",
            label=f"{label}: RMS |T dE/dg|",
        )
        ax_d.plot(t, traces.ones_drift[:, b].numpy(), color=colors[b], label=f"{label}: along all-ones")
        ax_d.plot(t, traces.radial_drift[:, b].numpy(), color=colors[b], linestyle=":", label=f"{label}: radial")
    ax_e.set(title="Energy E(t) (must never rise)", xlabel="time t", ylabel="energy E")
    ax_r.set(
        title="Motion of g: solid RMS |dg/dt|, dashed RMS |T dE/dg|\n(power law = straight line)",
        ylabel="per element (log scale)",
        yscale="log",
    )
    ax_d.set(
        title="Drift of x along its zero modes since t0\nsolid: token mean (all-ones); dotted: scale sigma",
        xlabel="time t",
        ylabel="drift (units of x)",
    )
    _log_time_axis(ax_r)
    readable_log_axis(ax_r.yaxis)
    handles = [ax_e.get_lines()[b] for b in range(count)]
    ax_e.legend(handles=handles, fontsize="small", loc="upper right")
    for ax in (ax_e, ax_r, ax_d):
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"Convergence of {traces.energy.shape[1]} sample(s)"
        + (f" (first {count} drawn)" if count < traces.energy.shape[1] else "")
    )
    return _finish(fig, path, dpi)


def _normalized_tokens(xs: Tensor) -> Tensor:
    """``(x - mean) / std`` per token: ``g`` up to the model's ``gamma`` and ``delta``."""
    centered = xs - xs.mean(dim=-1, keepdim=True)
    return centered / centered.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(torch.finfo(xs.dtype).tiny)


def _pca(points: np.ndarray, dims: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Center and directions (rows) of the first ``dims`` principal components, and explained-variance ratios."""
    center = points.mean(axis=0)
    _, singular, vt = np.linalg.svd(points - center, full_matrices=False)
    variance = singular**2 / max((singular**2).sum(), np.finfo(float).tiny)
    return center, vt[:dims], variance[:dims]


def dense_trajectory(
    solution: Solution, *, points: int = 200, rtol: float = 1e-8, atol: float = 1e-10
) -> tuple[Tensor, Tensor]:
    """Re-integrate ``solution``'s field (dopri5) from its first saved state on ``points`` times from ``ts[0]``,
    log-spaced after it (the motion is fastest at the start).

    Args:
        solution: a solve with saved states.
        points: the number of times ``P``.
        rtol, atol: dopri5's tolerances.

    Returns:
        ``(ts (P,), xs (P, *batch, N, D))``.
    """
    if not (isinstance(points, int) and points >= 3):
        raise ValueError(f"points must be an integer >= 3, got {points!r}")
    if solution.xs is None:
        raise ValueError("solution must hold saved states (solve with save='all' or 'steps') to re-integrate from")
    ts = solution.ts.detach().to(torch.float64)
    t0, t1 = float(ts[0]), float(ts[-1])
    offsets = torch.logspace(np.log10((t1 - t0) * 1e-4), np.log10(t1 - t0), points - 1, dtype=torch.float64)
    grid = torch.cat([ts[:1], t0 + offsets])
    with torch.no_grad():
        dense = solve(
            solution.field,
            solution.xs[0].detach(),
            grid.to(solution.xs.dtype),
            solver=Adaptive(rtol=rtol, atol=atol),
            max_steps=100_000,
        )
    assert dense.xs is not None  # save="all", the default
    return grid, dense.xs


def plot_trajectories(
    solution: Solution,
    *,
    sample: int = 0,
    dims: int = 2,
    color_by: Literal["time", "energy"] = "time",
    dense: int | None = None,
    path: PathLike | None = None,
    figsize: tuple[float, float] = (8.0, 6.5),
    dpi: int = 100,
) -> Figure:
    """Token trajectories of one sample projected on their first ``dims`` (2 or 3) principal components.

    The tokens are normalized as ``(x - mean) / std`` (the activation ``g`` up to ``gamma`` and ``delta``,
    so the drifts of ``x`` along its zero modes do not show); for a neuron of Euclidean geometry they are drawn as
    they are (``D >= dims`` needed). Each token is a line colored by time or by
    the sample's energy (``color_by``); circles mark the starts, stars the final states (at the fixed point once converged).
    ``dense``: draw ``dense`` states re-integrated from the first saved one (:func:`dense_trajectory`, log-spaced
    in time) instead of the saved ones, so the fast early motion is resolved rather than drawn as straight lines.

    Args:
        solution: a solve with saved states ``(T, *batch, N, D)``.
        sample: the sample drawn.
        dims: 2 or 3 principal components.
        color_by: ``"time"`` or ``"energy"``.
        dense: the number of re-integrated states, or None (the saved ones).
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.

    Returns:
        The matplotlib ``Figure``.
    """
    if dims not in (2, 3):
        raise ValueError(f"dims must be 2 or 3, got {dims!r}")
    if color_by not in ("time", "energy"):
        raise ValueError(f"color_by must be 'time' or 'energy', got {color_by!r}")
    if not isinstance(solution, Solution) or solution.xs is None:
        raise ValueError("solution must be an et_ode.Solution with saved states (save='all' or 'steps')")
    times, xs = (solution.ts.detach(), solution.xs.detach()) if dense is None else dense_trajectory(solution, points=dense)
    xs = xs.reshape(xs.shape[0], -1, *xs.shape[-2:])
    b = _sample_index(sample, xs.shape[1])
    if xs.shape[-1] < dims:
        raise ValueError(f"dims must be at most the token size D={xs.shape[-1]}, got {dims}")
    spheres = solution.field.model.neuron.geometry == "spheres"
    tokens = (_normalized_tokens(xs[:, b].to(torch.float64)) if spheres else xs[:, b].to(torch.float64)).cpu().numpy()
    steps, count, dim = tokens.shape
    center, axes, variance = _pca(tokens.reshape(-1, dim), dims)
    projected = (tokens - center) @ axes.T  # (T, N, dims)
    if color_by == "time":
        values, label = times.to(torch.float64).cpu().numpy(), "time t"
    else:
        with torch.no_grad():
            energies = flat_field(solution).select(b).energy(xs[:, b])
        values, label = energies.to(torch.float64).cpu().numpy(), "energy E"
    norm = Normalize(values.min(), values.max() if values.max() > values.min() else values.min() + 1)
    if color_by == "time" and len(values) > 2 and values[1] > 0 and values[-1] / values[1] > 50:
        norm, label = LogNorm(values[1], values[-1], clip=True), "time t (log color scale)"  # early motion is fast
    fig = Figure(figsize=figsize, layout="constrained")
    ax: Any = fig.add_subplot(projection="3d" if dims == 3 else None)  # Axes, or Axes3D (set_zlim) for dims=3
    cmap = "viridis" if color_by == "time" else "plasma"
    segment_values = (values[1:] + values[:-1]) / 2
    for a in range(count):
        path_a = projected[:, a]
        segments = np.stack([path_a[:-1], path_a[1:]], axis=1)
        if dims == 3:
            from mpl_toolkits.mplot3d.art3d import Line3DCollection

            lines = Line3DCollection(segments, cmap=cmap, norm=norm, linewidth=1.5)
        else:
            lines = LineCollection(list(segments), cmap=cmap, norm=norm, linewidth=1.5)
        lines.set_array(segment_values)
        ax.add_collection(lines)
    start, end = projected[0], projected[-1]
    ax.scatter(*start.T, facecolors="none", edgecolors="black", s=30, label="start (t0)")
    ax.scatter(
        *end.T,
        marker="*",
        color="red",
        edgecolors="black",
        s=160,
        zorder=5,
        label=f"final state (t = {float(times[-1]):.3g})",
    )
    if dims == 2:
        ax.autoscale()
        ax.set_aspect("equal", adjustable="datalim")
    else:
        for setter, column in zip((ax.set_xlim, ax.set_ylim, ax.set_zlim), projected.reshape(-1, 3).T, strict=True):
            pad = 0.05 * (column.max() - column.min() + 1e-12)
            setter(column.min() - pad, column.max() + pad)
        ax.set_zlabel(f"PC 3 ({100 * variance[2]:.0f}% var.)")
    ax.set_xlabel(f"PC 1 ({100 * variance[0]:.0f}% of variance)")
    ax.set_ylabel(f"PC 2 ({100 * variance[1]:.0f}% of variance)")
    ax.set_title(
        f"Sample {b}: {count} token trajectories of the {'normalized state (x - mean)/std' if spheres else 'state x'},\n"
        f"first {dims} principal components, colored by {label}"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 if dims == 2 else -0.02), ncol=2, fontsize="small")
    fig.colorbar(lines, ax=ax, label=label, shrink=0.8)
    return _finish(fig, path, dpi)


@dataclass
class EnergySlice:
    """A 2-D slice of the product of spheres: ``g(a, b) = retract(g_star + a u + b v)`` (each token put back
    on its sphere), ``u, v`` orthonormal ``(N, D)`` directions in ``g``; for a Euclidean neuron the plane itself in
    its coordinates ``x`` (:mod:`et_ode.analysis.chart`; ``g_star`` then holds ``x*``). With a trajectory, the plane holds
    its start and its end exactly (``u`` along ``g_start - g*``, ``v`` along the end's part orthogonal to it, or
    the trajectory's main direction orthogonal to ``u`` when the end is at ``g*``).

    Attributes:
        field: the vector field.
        g_star: the center of the slice ``(N, D)`` (``x*`` for a Euclidean neuron).
        u: the first direction ``(N, D)``, unit.
        v: the second direction ``(N, D)``, unit and orthogonal to ``u``.
        coords: the trajectory's coordinates ``(T, 2)``, or None without a trajectory.
        off_plane: the trajectory's distance from the plane ``(T,)`` (``g`` units), or None.
        distance: the trajectory's distance from ``g*`` ``(T,)``, or None.
    """

    field: ETField
    g_star: Tensor
    u: Tensor
    v: Tensor
    coords: Tensor | None = None
    off_plane: Tensor | None = None
    distance: Tensor | None = None

    def points(self, a: Tensor, b: Tensor) -> Tensor:
        """``g(a, b)`` for coordinates of any shape ``S``: ``(*S, N, D)``.

        Args:
            a: the coordinates along ``u``, shape ``S``.
            b: the coordinates along ``v``, shape ``S``.

        Returns:
            The states ``(*S, N, D)`` (``g`` on the spheres; ``x`` for a Euclidean neuron).
        """
        offsets = a[..., None, None] * self.u + b[..., None, None] * self.v
        return chart_for(self.field).move(self.g_star.expand_as(offsets), offsets)

    def energy(self, a: Tensor, b: Tensor) -> Tensor:
        """The energy on the slice at coordinates ``a, b``, with the field's mask.

        Args:
            a: the coordinates along ``u``, shape ``S``.
            b: the coordinates along ``v``, shape ``S``.

        Returns:
            The energies, shape ``S`` (not differentiated).
        """
        with torch.no_grad():
            return chart_for(self.field).energy(self.points(a, b))


def energy_slice(field: ETField, x_fixed: Tensor, *, trajectory: Tensor | None = None, seed: int = 0) -> EnergySlice:
    """The slice through ``x_fixed`` (see :class:`EnergySlice`).

    Args:
        field: the vector field.
        x_fixed: the fixed point ``(N, D)``.
        trajectory: states ``(T, N, D)`` whose start and end the plane holds, or None (random tangent directions).
        seed: the random directions.

    Returns:
        The :class:`EnergySlice`.
    """
    chart = chart_for(field)
    with torch.no_grad():
        g_star = chart.coordinates(x_fixed.detach())
        project = chart.projector(x_fixed.detach()[None])

        def unit_orthogonal(w: Tensor, to: list[Tensor]) -> Tensor | None:
            for axis in to:
                w = w - (w * axis).sum() * axis
            norm = w.norm()
            return w / norm if float(norm) > 1e-9 * max(1.0, float(g_star.norm())) else None

        def random_direction(w: Tensor, to: list[Tensor]) -> Tensor:
            direction = unit_orthogonal(w, to)
            if direction is None:
                raise ValueError("x_fixed has no tangent plane to slice: its tokens sit at the centre of their spheres")
            return direction

        generator = torch.Generator().manual_seed(seed)
        random = [
            project(torch.randn(g_star.shape, generator=generator, dtype=g_star.dtype).to(g_star.device)[None])[0]
            for _ in range(3)
        ]
        coords = off_plane = distance = None
        if trajectory is None:
            u = random_direction(random[0], [])
            v = random_direction(random[1], [u])
        else:
            path_g = chart.coordinates(trajectory.detach()) - g_star  # (T, N, D)
            start = unit_orthogonal(path_g[0], [])
            u = random_direction(random[0], []) if start is None else start
            end = unit_orthogonal(path_g[-1], [u])
            if end is not None:
                v = end
            else:  # the end is at g* (or on the line): the trajectory's main direction orthogonal to u
                rest = path_g - (path_g * u).sum(dim=(-1, -2), keepdim=True) * u
                _, _, vt = torch.linalg.svd(rest.reshape(len(rest), -1), full_matrices=False)
                main = unit_orthogonal(vt[0].reshape(g_star.shape), [u])
                v = random_direction(random[1], [u]) if main is None else main
            a, b = (path_g * u).sum(dim=(-1, -2)), (path_g * v).sum(dim=(-1, -2))
            coords = torch.stack([a, b], dim=1)
            off_plane = (path_g - a[:, None, None] * u - b[:, None, None] * v).flatten(1).norm(dim=1)
            distance = path_g.flatten(1).norm(dim=1)
    return EnergySlice(field=field, g_star=g_star, u=u, v=v, coords=coords, off_plane=off_plane, distance=distance)


def plot_energy_slice(
    field: ETField,
    x_fixed: Tensor,
    *,
    trajectories: Solution | Tensor | None = None,
    span: float | None = None,
    resolution: int = 41,
    sample: int = 0,
    seed: int = 0,
    path: PathLike | None = None,
    figsize: tuple[float, float] = (8.0, 6.5),
    dpi: int = 100,
) -> Figure:
    """Contours of ``E`` on a 2-D slice of the product of spheres through the fixed point ``x_fixed``.

    ``x_fixed``: ``(N, D)`` or ``(B, N, D)`` (``sample`` picks one). The slice (:func:`energy_slice`) is
    ``g(a, b) = retract(g* + a u + b v)``: with ``trajectories`` (a Solution or states ``(T, N, D)`` /
    ``(T, B, N, D)``) the plane through ``g*``, the trajectory's start and its end, so the energy drawn under
    the start and the end is the energy there; elsewhere the trajectory leaves the plane, and its largest
    distance from it is printed on the picture. Without, random tangent directions.

    Args:
        field: the vector field (LayerNorm neuron).
        x_fixed: the fixed point, ``(N, D)`` or ``(B, N, D)``.
        trajectories: a Solution or states ``(T, N, D)`` / ``(T, B, N, D)``, or None.
        span: half-width in ``g`` units (default: 1.2 times the trajectory's extent, or half a token radius).
        resolution: grid points per side.
        sample: the sample of a batch drawn.
        seed: the random directions (without ``trajectories``).
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.

    Returns:
        The matplotlib ``Figure``.
    """
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    if not (isinstance(resolution, int) and resolution >= 3):
        raise ValueError(f"resolution must be an integer >= 3, got {resolution!r}")
    if not isinstance(x_fixed, Tensor) or x_fixed.dim() not in (2, 3) or x_fixed.shape[-1] != field.model.dim:
        raise ValueError(
            f"x_fixed must be a tensor (N, D) or (B, N, D) with D={field.model.dim}, got "
            f"{tuple(x_fixed.shape) if isinstance(x_fixed, Tensor) else type(x_fixed).__name__}"
        )
    xf = x_fixed.detach().reshape(-1, *x_fixed.shape[-2:])
    b = _sample_index(sample, xf.shape[0])
    bound = field.select(b)
    states = None
    if trajectories is not None:
        states = trajectories.xs if isinstance(trajectories, Solution) else trajectories
        if not isinstance(states, Tensor) or tuple(states.shape[-2:]) != tuple(xf.shape[-2:]) or states.dim() not in (3, 4):
            raise ValueError(
                f"trajectories must be a Solution with saved states or a tensor (T, N, D) / "
                f"(T, B, N, D) matching x_fixed's (N, D)={tuple(xf.shape[-2:])}"
            )
        states = states.detach().reshape(states.shape[0], -1, *states.shape[-2:])[:, b if states.dim() == 4 else 0]
    plane = energy_slice(bound, xf[b], trajectory=states, seed=seed)
    coords = None if plane.coords is None else plane.coords.cpu().numpy()
    g_star = plane.g_star
    if span is None:
        chart = chart_for(bound)
        center = chart.delta if isinstance(chart, SphereChart) else torch.zeros_like(g_star)  # the spheres' centre
        radius = float((g_star - center).norm(dim=-1).mean()) or 1.0
        span = 1.2 * float(np.abs(coords).max()) if coords is not None and np.abs(coords).max() > 0 else radius / 2
    grid = torch.linspace(-span, span, resolution, dtype=g_star.dtype, device=g_star.device)
    a, c = torch.meshgrid(grid, grid, indexing="xy")
    energies = plane.energy(a, c).to(torch.float64).cpu().numpy()
    with torch.no_grad():
        e_star = float(chart_for(bound).energy(g_star))
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    axis = grid.cpu().numpy()
    filled = ax.contourf(axis, axis, energies, levels=20, cmap="viridis")
    ax.contour(axis, axis, energies, levels=20, colors="white", linewidths=0.4, alpha=0.6)
    fig.colorbar(filled, ax=ax, label="energy E on the slice")
    off_plane, distance = plane.off_plane, plane.distance
    if coords is not None and off_plane is not None and distance is not None:
        ax.plot(coords[:, 0], coords[:, 1], color="red", linewidth=1.5, label="trajectory (projected on the plane)")
        ax.scatter(coords[0, 0], coords[0, 1], facecolors="none", edgecolors="red", s=50, label="trajectory start")
        ax.scatter(coords[-1, 0], coords[-1, 1], marker="x", color="red", s=60, label="trajectory end")
        worst = int(off_plane.argmax())
        ratio = float(off_plane[worst] / distance[worst].clamp_min(torch.finfo(g_star.dtype).tiny))
        ax.text(
            0.02,
            0.02,
            f"start and end lie in the plane; the trajectory leaves it by at most\n"
            f"{float(off_plane[worst]):.3g} in g ({100 * ratio:.0f}% of its distance from g* there)",
            transform=ax.transAxes,
            fontsize="small",
            color="white",
            va="bottom",
            bbox={"facecolor": "black", "alpha": 0.5, "linewidth": 0},
        )
    ax.scatter(
        [0], [0], marker="*", s=220, color="white", edgecolors="black", zorder=5, label=f"fixed point (E = {e_star:.4g})"
    )
    ax.set(
        xlim=(-span, span),
        ylim=(-span, span),
        aspect="equal",
        xlabel="coordinate along u (units of g)",
        ylabel="coordinate along v (units of g)",
        title=f"Energy on a 2-D slice through the fixed point (sample {b})\n"
        f"u, v: {'plane through g*, start and end' if coords is not None else 'random tangent directions'}"
        ", tokens kept on their spheres",
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize="small")
    return _finish(fig, path, dpi)


def plot_attention(
    solution: Solution,
    *,
    sample: int = 0,
    head: int = 0,
    t: Sequence[float] | None = None,
    path: PathLike | None = None,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
) -> Figure:
    """Attention maps ``S[head, key B, query C]`` of one sample at a few saved times; default size: 3.6 inches per
    map, 4 tall.

    Args:
        solution: a solve with saved states ``(T, *batch, N, D)`` and an attention interaction.
        sample, head: the sample and head drawn.
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.
        t: the times (each uses the nearest saved one); default 4 from first to last.

    Returns:
        The figure of the maps.
    """
    xs = flat_states(solution)
    b = _sample_index(sample, xs.shape[1])
    field = flat_field(solution).select(b)
    attention = field.model.interactions.get("attention")
    if not isinstance(attention, EnergyAttention):
        raise ValueError(
            f"plot_attention draws an EnergyAttention interaction named 'attention'; the model "
            f"{type(field.model).__name__} has interactions {list(field.model.interactions)}"
        )
    heads = attention.heads
    if not isinstance(head, int) or not 0 <= head < heads:
        raise ValueError(f"head must be an integer in [0, {heads}), got {head!r}")
    ts = solution.ts.detach().to(torch.float64).cpu()
    if t is None:
        indices = sorted(set(np.linspace(0, len(ts) - 1, min(4, len(ts))).round().astype(int).tolist()))
    else:
        indices = [int((ts - float(time)).abs().argmin()) for time in t]
        if not indices:
            raise ValueError("t must name at least one time")
    with torch.no_grad():
        weights = attention.attention(field.model.neuron(xs[indices, b]), field.mask)[:, head]
    maps = weights.to(torch.float64).cpu().numpy()  # (len, B, C)
    figsize = figsize or (3.6 * len(indices) + 1.2, 4.0)
    fig = Figure(figsize=figsize, layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(indices)))
    images = [
        ax.imshow(attention, cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest")
        for ax, attention in zip(axes, maps, strict=True)
    ]
    for ax, k in zip(axes, indices, strict=True):
        ax.set(title=f"t = {float(ts[k]):.4g}", xlabel="query token C", ylabel="key token B")
    fig.colorbar(images[0], ax=list(axes), label="attention weight (softmax over keys B)")
    fig.suptitle(f"Attention of head {head}, sample {b}: column C sums to 1")
    return _finish(fig, path, dpi)


def _as_images(name: str, value: Tensor | np.ndarray, single: bool) -> np.ndarray:
    """``(T, H, W)``, ``(T, C, H, W)`` (or one frame without ``T`` when ``single``) to ``(T, H, W[, 3])``."""
    array = value.detach().to(torch.float64).cpu().numpy() if isinstance(value, Tensor) else np.asarray(value, float)
    if single:
        array = array[None]
    if array.ndim == 4:
        if array.shape[1] not in (1, 3):
            raise ValueError(f"{name} must have 1 or 3 channels in (T, C, H, W), got shape {array.shape}")
        array = array[:, 0] if array.shape[1] == 1 else np.moveaxis(array, 1, -1)
    elif array.ndim != 3:
        expected = "(H, W) or (C, H, W)" if single else "(T, H, W) or (T, C, H, W)"
        raise ValueError(f"{name} must have shape {expected}, got {array.shape[1:] if single else array.shape}")
    return array


def plot_film_strip(
    frames: Tensor | np.ndarray,
    ts: Sequence[float] | Tensor,
    *,
    target: Tensor | None = None,
    masked: Tensor | None = None,
    columns: int = 6,
    path: PathLike | None = None,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
) -> Figure:
    """Rows of images: the masked input (if given), the completion at each time, the ground truth (if given).

    All panels share one intensity scale (shown by a colorbar for grayscale); default size: 2.0 inches per panel,
    2.4 per row.

    Args:
        frames: ``(T, H, W)`` grayscale or ``(T, C, H, W)`` with ``C`` 1 or 3.
        ts: their ``T`` times.
        target, masked: one image ``(H, W)`` or ``(C, H, W)`` each, or None.
        columns: panels per row at most.
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.

    Returns:
        The figure of the strip.
    """
    images = _as_images("frames", frames, single=False)
    times = [float(t) for t in (ts.tolist() if isinstance(ts, Tensor) else ts)]
    if len(times) != len(images):
        raise ValueError(f"ts must have one time per frame ({len(images)}), got {len(times)}")
    panels = [(f"t = {t:.3g}", image) for t, image in zip(times, images, strict=True)]
    for name, extra, position in (("masked input", masked, 0), ("ground truth", target, None)):
        if extra is not None:
            image = _as_images(name, extra, single=True)[0]
            if image.shape != images.shape[1:]:
                raise ValueError(f"{name} must match the frames' image shape {images.shape[1:]}, got {image.shape}")
            panels.insert(len(panels) if position is None else position, (name, image))
    low = min(float(p.min()) for _, p in panels)
    high = max(float(p.max()) for _, p in panels)
    high = high if high > low else low + 1.0
    check_positive("columns", columns, integer=True)
    cols = min(columns, len(panels))
    rows = -(-len(panels) // cols)
    figsize = figsize or (2.0 * cols + 1.0, 2.4 * rows + 0.5)
    fig = Figure(figsize=figsize, layout="constrained")
    grid = np.atleast_1d(fig.subplots(rows, cols)).reshape(-1)
    axes = grid[: len(panels)]
    for spare in grid[len(panels) :]:
        spare.set_axis_off()
    image = None
    for ax, (title, picture) in zip(axes, panels, strict=True):
        color = picture.ndim == 3
        shown = np.clip((picture - low) / (high - low), 0, 1) if color else picture
        image = ax.imshow(
            shown,
            cmap=None if color else "gray",
            vmin=None if color else low,
            vmax=None if color else high,
            interpolation="nearest",
        )
        ax.set_title(title, fontsize="medium", fontweight="bold" if title in ("masked input", "ground truth") else None)
        ax.set_xticks([])
        ax.set_yticks([])
    if images.ndim == 3:
        fig.colorbar(image, ax=list(axes), label="intensity", shrink=0.9)
    fig.suptitle("Completion over time (time runs left to right)")
    return _finish(fig, path, dpi)
