"""Which minima an index-1 saddle joins, the minima-saddle network with its barriers, a disconnectivity graph.

From an index-1 saddle the flow leaves along the unstable eigenvector in both directions; each branch is
followed with :func:`et_ode.solve` and finished by descent and Newton on the spheres, which identifies the
minimum it reaches (modulo token permutations where that is a symmetry). The barrier from a minimum is
``E(saddle) - E(minimum)``. The disconnectivity graph (Becker and Karplus) draws each minimum as a line
from its energy up to the lowest saddle energy at which it joins the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from matplotlib.figure import Figure

from et_ode import Adaptive, ETField, solve
from et_ode.analysis._tables import Table
from et_ode.analysis.chart import chart_for
from et_ode.analysis.critical_points import (
    CriticalPoint,
    deduplicate,
    match_or_append,
    newton_critical_point,
    permutation_symmetric,
)
from et_ode.analysis.plots import _finish
from et_ode.analysis.stability import find_fixed_point

PathLike = str | os.PathLike[str]


@dataclass
class Connection:
    """An index-1 saddle and the minima its two descending branches reach.

    Attributes:
        saddle: the saddle's index into the network's saddles.
        minima: the minima's indices into the network's minima, one per branch (``-1``: a branch that did not end
            at a minimum).
        barriers: the barriers ``E_s - E_min`` from each side (``nan`` for a branch without a minimum).
    """

    saddle: int
    minima: tuple[int, int]
    barriers: tuple[float, float]


@dataclass
class Network(Table):
    """Minima, index-1 saddles and the connections between them.

    Attributes:
        minima: the distinct minima, in ascending energy.
        saddles: the index-1 saddles.
        connections: one per saddle.
    """

    minima: list[CriticalPoint]
    saddles: list[CriticalPoint]
    connections: list[Connection]

    def table(self) -> str:
        lines = ["| saddle | E saddle | joins minima | E minima | barriers |", "|---|---|---|---|---|"]
        for c in self.connections:
            energies = " / ".join("?" if m < 0 else f"{self.minima[m].energy:.6g}" for m in c.minima)
            barriers = " / ".join(f"{b:.4g}" for b in c.barriers)
            lines.append(
                f"| {c.saddle} | {self.saddles[c.saddle].energy:.6g} | {c.minima[0]} - {c.minima[1]} | "
                f"{energies} | {barriers} |"
            )
        return "\n".join(lines)


def follow_down(
    field: ETField,
    saddle: CriticalPoint,
    *,
    push: float = 1e-3,
    t1: float = 50.0,
    rtol: float = 1e-8,
    atol: float = 1e-10,
) -> tuple[CriticalPoint, CriticalPoint]:
    """The two critical points reached from ``saddle`` pushed ``push`` (coordinate units: ``g`` on the spheres)
    along ``+-`` its lowest mode: :func:`et_ode.solve` to ``t1``, then descent and Newton in the chart."""
    chart = chart_for(field)
    steps = torch.stack([sign * push * saddle.lowest_mode for sign in (1.0, -1.0)])
    starts = chart.rescaled(chart.retract(saddle.x.expand_as(steps), steps))
    with torch.no_grad():
        ends = solve(field, starts, (0.0, t1), solver=Adaptive(rtol=rtol, atol=atol), save="final", max_steps=100_000).x
    descended = find_fixed_point(field, ends, tol=1e-7, max_iter=5000).x
    plus, minus = (newton_critical_point(field, x) for x in descended)
    return plus, minus


def saddle_network(
    field: ETField,
    minima: list[CriticalPoint],
    saddles: list[CriticalPoint],
    *,
    match_tol: float = 1e-5,
    push: float = 1e-3,
    t1: float = 50.0,
) -> Network:
    """Connect every index-1 saddle to the minima its two unstable branches reach.

    Minima reached that are not in ``minima`` are added (so the network is complete for these saddles).

    Args:
        field: the vector field.
        minima: the known minima.
        saddles: the saddles to connect, each of index 1 (ValueError otherwise).
        match_tol: the distance within which two points are one.
        push: the step off the saddle along each unstable direction, in ``g`` units.
        t1: the end time of each branch's flow.

    Returns:
        The :class:`Network` of minima, saddles and their connections.
    """
    if any(s.index != 1 for s in saddles):
        raise ValueError("saddles must all have index 1")
    permutations = permutation_symmetric(field)
    minima = [e.point for e in deduplicate(field, list(minima), match_tol=match_tol, permutations=permutations)]
    connections = []
    for k, saddle in enumerate(saddles):
        ends = []
        for end in follow_down(field, saddle, push=push, t1=t1):
            if not (end.converged and end.index == 0):
                ends.append(-1)
                continue
            ends.append(match_or_append(field, minima, end, permutations=permutations, match_tol=match_tol))
        barriers = tuple(saddle.energy - minima[i].energy if i >= 0 else float("nan") for i in ends)
        connections.append(Connection(saddle=k, minima=(ends[0], ends[1]), barriers=barriers))  # type: ignore[arg-type]
    return Network(minima=minima, saddles=list(saddles), connections=connections)


def disconnectivity(network: Network) -> list[tuple[float, set[int]]]:
    """The merge events of the disconnectivity graph (union-find over the connections, lowest saddles first).

    Args:
        network: the minima, saddles and connections.

    Returns:
        ``(saddle energy, minima of the merged group)`` pairs in ascending energy.
    """
    parent = list(range(len(network.minima)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    events = []
    for c in sorted(network.connections, key=lambda c: network.saddles[c.saddle].energy):
        a, b = c.minima
        if a < 0 or b < 0 or root(a) == root(b):
            continue
        parent[root(b)] = root(a)
        group = {i for i in range(len(parent)) if root(i) == root(a)}
        events.append((network.saddles[c.saddle].energy, group))
    return events


def plot_disconnectivity(
    network: Network, *, path: PathLike | None = None, figsize: tuple[float, float] = (7.0, 5.0), dpi: int = 100
) -> Figure:
    """The disconnectivity graph: a vertical line per minimum from its energy up to where it merges (at the
    connecting saddle's energy), horizontal bars at the merges. Minima that never merge reach the top.

    Args:
        network: the minima, saddles and connections (:func:`saddle_network`).
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.

    Returns:
        The figure of the graph.
    """
    count = len(network.minima)
    energies = np.array([m.energy for m in network.minima])
    events = disconnectivity(network)
    top = max([e for e, _ in events] + [float(energies.max())]) if count else 1.0
    span = top - (float(energies.min()) if count else 0.0) or 1.0
    position = {i: float(i) for i in range(count)}
    height = {i: float(energies[i]) for i in range(count)}
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    members = {i: {i} for i in range(count)}  # current groups, keyed by a representative
    for level, group in events:
        parts = [r for r in list(members) if members[r] & group]
        xs = [position[r] for r in parts]
        for r in parts:
            ax.plot([position[r]] * 2, [height[r], level], color="black")
        ax.plot([min(xs), max(xs)], [level, level], color="black")
        new = min(parts)
        members[new] = set().union(*(members.pop(r) for r in parts))
        position[new], height[new] = float(np.mean(xs)), level
    for r in members:
        ax.plot([position[r]] * 2, [height[r], top + 0.08 * span], color="black")
    for i in range(count):
        ax.annotate(f"m{i}", (i, energies[i]), textcoords="offset points", xytext=(0, -12), ha="center", fontsize="small")
    ax.set(
        xticks=[],
        ylabel="energy E",
        xlim=(-0.7, count - 0.3),
        ylim=(float(energies.min()) - 0.1 * span if count else 0, top + 0.1 * span),
        title=f"Disconnectivity graph: {count} minima, {len(network.saddles)} index-1 saddles\n"
        "minima join at the energy of the lowest saddle connecting them",
    )
    ax.grid(True, axis="y", alpha=0.3)
    return _finish(fig, path, dpi)
