"""How far a fixed point's basin reaches: random tangent perturbations of growing size, followed by the flow.

:func:`basin_probe` perturbs each fixed point, follows the dynamics with :func:`flow` (which undoes the plain flow's
slowing time change between segments by :func:`~et_ode.dynamics.manifold.shrink_scale`, keeping the path of ``g``)
and counts the trials that come back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from et_ode import Adaptive, ETField, solve
from et_ode.analysis.chart import chart_for
from et_ode.analysis.stability import batched_states
from et_ode.integrators.solvers import AdaptiveMethod


def flow(
    field: ETField,
    x: Tensor,
    t1: float,
    *,
    segments: int = 1,
    restart: bool = True,
    method: AdaptiveMethod = "dopri5",
    rtol: float = 1e-7,
    atol: float = 1e-9,
) -> Tensor:
    """Integrate the dynamics from 0 to ``t1`` in ``segments`` consecutive spans of ``t1 / segments``; with
    ``restart`` each span starts from ``shrink_scale(x)`` (each sample shrunk by one factor to token scales of at
    most 1: the same path of ``g``, undone slow-down; a Euclidean neuron's flow has none to undo).

    Args:
        field: the vector field.
        x: start states ``(B, N, D)``.
        t1: the end time.
        segments: the number of spans.
        restart: shrink the scale at the start of each span.
        method, rtol, atol: the adaptive solver.

    Returns:
        The final ``x``, ``(B, N, D)``.
    """
    chart = chart_for(field)
    for _ in range(segments):
        if restart:
            x = chart.rescaled(x)
        x = solve(field, x, (0.0, t1 / segments), solver=Adaptive(method, rtol, atol), save="final").x.detach()
    return x


@dataclass
class BasinProbe:
    """How far from fixed points perturbations come back. Radii are RMS per element of the g-perturbation divided
    by ``gamma`` (of the x-perturbation for a Euclidean neuron).

    Attributes:
        radii: the perturbation sizes, increasing.
        returned: ``returned[b, j]``, the fraction of the trials at radius ``radii[j]`` that came back (final
            g-distance to the fixed point at most ``shrink`` times the initial one), ``(B, len(radii))``.
        final_distance: each trial's final distance to the fixed point (same units as the radii),
            ``(B, len(radii), trials)``.
        radius: ``radius[b]``, the largest radius up to which every trial came back (0 if none).
        shrink: the factor by which a trial's distance must shrink to count as returned.
    """

    radii: list[float]
    returned: Tensor
    final_distance: Tensor
    radius: list[float]
    shrink: float


def basin_probe(
    field: ETField,
    x_star: Tensor,
    *,
    radii: list[float] | None = None,
    trials: int = 4,
    t1: float = 20.0,
    segments: int = 10,
    shrink: float = 0.5,
    seed: int = 0,
    rtol: float = 1e-7,
    atol: float = 1e-9,
    progress: bool = False,
) -> BasinProbe:
    """Perturb the fixed point(s) ``x_star`` (``(B, N, D)``) with random tangent noise of growing size and
    follow the dynamics (with scale restarts, see :func:`flow`) from 0 to ``t1``.

    Args:
        field: the vector field.
        x_star: fixed points ``(B, N, D)`` or ``(N, D)``.
        radii: increasing perturbation sizes (default ``0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1``).
        trials: random perturbations per radius and sample.
        t1: the end time of each trial's flow.
        segments: the flow's spans between scale restarts.
        shrink: a trial returns when its final distance is at most ``shrink`` times the initial one.
        seed: the random perturbations.
        rtol, atol: the flow's tolerances.
        progress: show a progress bar.

    Returns:
        A :class:`BasinProbe`.

    Raises:
        ValueError: ``radii`` not positive and increasing.
    """
    from tqdm.auto import tqdm

    chart = chart_for(field)
    x = chart.canonical(batched_states(x_star, field, "x_star"))
    radii = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0] if radii is None else [float(r) for r in radii]
    if not radii or any(not r > 0 for r in radii) or sorted(radii) != radii:
        raise ValueError(f"radii must be positive and increasing, got {radii}")
    unit = chart.unit
    generator = torch.Generator().manual_seed(seed)
    batch, n, d = x.shape
    with torch.no_grad():
        g_star = chart.coordinates(x)
    starts = x.repeat(trials, 1, 1)  # (trials * B, N, D), trial-major
    project = chart.projector(starts)
    target = g_star.repeat(trials, 1, 1)
    returned = torch.zeros(batch, len(radii), dtype=torch.float64)
    final = torch.zeros(batch, len(radii), trials, dtype=torch.float64)
    for j, radius in enumerate(tqdm(radii, desc="basin probe", disable=not progress, leave=False)):
        w = project(torch.randn(starts.shape, generator=generator, dtype=x.dtype).to(x.device))
        w = w * radius * unit / w.square().mean(dim=(-1, -2), keepdim=True).sqrt()
        perturbed = chart.retract(starts, w)
        with torch.no_grad():
            initial = (chart.coordinates(perturbed) - target).square().mean(dim=(-1, -2)).sqrt()
        end = flow(field, perturbed, t1, segments=segments, rtol=rtol, atol=atol)
        with torch.no_grad():
            distance = (chart.coordinates(end) - target).square().mean(dim=(-1, -2)).sqrt()
        back = (distance <= shrink * initial).reshape(trials, batch)
        returned[:, j] = back.to(torch.float64).mean(dim=0).cpu()
        final[:, j] = (distance / unit).reshape(trials, batch).T.to(torch.float64).cpu()
    radius_per_sample = []
    for b in range(batch):
        full = (returned[b] == 1.0).tolist()
        count = full.index(False) if False in full else len(full)
        radius_per_sample.append(radii[count - 1] if count else 0.0)
    return BasinProbe(radii=radii, returned=returned, final_distance=final, radius=radius_per_sample, shrink=shrink)
