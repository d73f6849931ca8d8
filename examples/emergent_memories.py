"""Emergent memories of the log-sum-ReLU Dense Associative Memory, found and certified with et-ode's toolkit.

Reference: B. Hoover, Z. Shi, K. Balasubramanian, D. Krotov, P. Ram, "Dense Associative Memory with Epanechnikov
Energy", NeurIPS 2025 (arXiv:2506.10801), Figure 1. Its energy of a state ``x`` in ``d`` dimensions with stored
patterns ``xi_mu`` is

    E(x) = -(1/beta) log(eps + sum_mu relu(1 - (beta/2) |x - xi_mu|^2)),      eps = 1e-6 (the figure's),

whose local minima are the centroids ``c_S`` of the sets ``S`` of patterns whose supports
(``|x - xi| < sqrt(2 / beta)``) contain ``c_S`` and whose complement's do not: the patterns themselves (preserved
memories, ``|S| = 1``) and new points between them (emergent memories, ``|S| > 1``). Figure 1 draws two patterns at
``-1, 1`` for beta 0.4, 0.9, 2.1 and three at the corners of an equilateral triangle of side 2 for beta 0.3, 0.6,
1.1, 2.1.

Here the energy is written against et-ode's public interface only (an ``et_ode.Interaction`` and the
``et_ode.IdentityNeuron``, ``g = x``), and its minima are found by ``et_ode.find_attractor`` from a grid of starts:
the flow, Newton, and the certificate (a converged, stable point tied to the flow's basin). The distinct certified
points are compared with the enumeration above: their count per beta (preserved and emergent), their positions
against the centroids, and the certificate's smallest Hessian eigenvalue against the closed form
``|S| / (eps + sum_S (1 - (beta/2) |c_S - xi|^2))`` (the Hessian is that multiple of the identity at ``c_S``).

    python examples/emergent_memories.py [--out docs/guides/emergent_memories.png] [--grid 41]
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

import et_ode

EPS = 1e-6
ONE_D = (torch.tensor([[-1.0], [1.0]], dtype=torch.float64), (0.4, 0.9, 2.1))
TWO_D = (
    torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, -2 * math.cos(math.pi / 6)]], dtype=torch.float64),
    (0.3, 0.6, 1.1, 2.1),
)


class LogSumReLU(et_ode.Interaction):
    """The log-sum-ReLU energy of every token: ``-(1/beta) log(eps + sum_mu relu(1 - beta |g - xi_mu|^2 / 2))``."""

    def __init__(self, patterns: torch.Tensor, beta: float, eps: float = EPS):
        super().__init__()
        self.xi = torch.nn.Parameter(patterns)
        self.beta, self.eps = beta, eps

    def energy(self, g: torch.Tensor, mask: object = None) -> torch.Tensor:
        distances = (g[..., None, :] - self.xi).square().sum(dim=-1)  # (..., N, K)
        support = torch.relu(1 - 0.5 * self.beta * distances).sum(dim=-1)
        return -(torch.log(self.eps + support) / self.beta).sum(dim=-1)


def enumerated_minima(patterns: torch.Tensor, beta: float) -> list[tuple[torch.Tensor, int, float]]:
    """The reference: ``(centroid, |S|, Hessian eigenvalue)`` of every set ``S`` whose centroid is a minimum."""
    minima = []
    for size in range(1, len(patterns) + 1):
        for subset in itertools.combinations(range(len(patterns)), size):
            centroid = patterns[list(subset)].mean(dim=0)
            inside = 0.5 * beta * (centroid - patterns).square().sum(dim=-1) < 1
            if set(torch.nonzero(inside).flatten().tolist()) == set(subset):
                q = EPS + float((1 - 0.5 * beta * (centroid - patterns[list(subset)]).square().sum(dim=-1)).sum())
                minima.append((centroid, size, size / q))
    return minima


def starts(patterns: torch.Tensor, count: int) -> torch.Tensor:
    """A grid of ``count`` (1-D) or ``count^2`` (2-D) one-token states over the patterns' neighbourhood."""
    low, high = patterns.min(dim=0).values - 1.1, patterns.max(dim=0).values + 1.1
    axes = [torch.linspace(float(a), float(b), count, dtype=torch.float64) for a, b in zip(low, high, strict=True)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(axes))
    return grid[:, None, :]  # (S, N=1, d)


def certified_minima(patterns: torch.Tensor, beta: float, count: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The distinct certified attractors from the grid of starts: ``(points (m, d), smallest eigenvalues (m,),
    certified starts)``."""
    model = et_ode.EnergyModel(et_ode.IdentityNeuron(patterns.shape[1]), {"lsr": LogSumReLU(patterns, beta)})
    with torch.no_grad():
        found = et_ode.find_attractor(et_ode.ETField(model), starts(patterns, count))
    certified = found.certified
    points, eigenvalues = found.x[certified][:, 0], found.smallest_eigenvalue[certified]
    distinct: list[int] = []
    for i in range(len(points)):
        if all(float((points[i] - points[j]).norm()) > 1e-6 for j in distinct):
            distinct.append(i)
    return points[distinct], eigenvalues[distinct], int(certified.sum())


def compare(patterns: torch.Tensor, beta: float, count: int) -> dict[str, float]:
    """Counts (reference and measured), and the largest position and relative eigenvalue differences."""
    reference = enumerated_minima(patterns, beta)
    points, eigenvalues, certified = certified_minima(patterns, beta, count)
    position_error = eigenvalue_error = 0.0
    matched = 0
    for centroid, _, eigenvalue in reference:
        distance = (points - centroid).norm(dim=-1) if len(points) else torch.full((1,), math.inf)
        nearest = int(distance.argmin())
        if float(distance[nearest]) < 1e-3:
            matched += 1
            position_error = max(position_error, float(distance[nearest]))
            eigenvalue_error = max(eigenvalue_error, abs(float(eigenvalues[nearest]) / eigenvalue - 1))
    return {
        "beta": beta,
        "preserved": sum(size == 1 for _, size, _ in reference),
        "emergent": sum(size > 1 for _, size, _ in reference),
        "found_preserved": sum(bool(((points - p).norm(dim=-1) < 1e-3).any()) for p in patterns),
        "found": len(points),
        "matched": matched,
        "certified_starts": certified,
        "position_error": position_error,
        "eigenvalue_error": eigenvalue_error,
        "points": points.tolist(),
    }


def energy_grid(patterns: torch.Tensor, beta: float, axes: list[torch.Tensor]) -> np.ndarray:
    model = et_ode.EnergyModel(et_ode.IdentityNeuron(patterns.shape[1]), [LogSumReLU(patterns, beta)])
    grid = torch.stack(torch.meshgrid(*axes, indexing="xy"), dim=-1)
    with torch.no_grad():
        return model.energy(grid[..., None, :]).numpy()


def plot(rows: dict[int, list[dict[str, float]]], path: Path) -> None:
    fig = Figure(figsize=(16, 7), layout="constrained")
    panels = fig.subplots(2, 4)
    for column, row in enumerate(rows[1]):
        ax = panels[0, column]
        xs = torch.linspace(-2.1, 2.1, 401, dtype=torch.float64)
        ax.plot(xs.numpy(), energy_grid(ONE_D[0], row["beta"], [xs]), color="gray")
        _mark(ax, row, ONE_D[0], one_d=True)
        ax.set(title=f"1-D, beta = {row['beta']}", xlabel="x", ylabel="E")
    _table(panels[0, 3], rows)
    for column, row in enumerate(rows[2]):
        ax = panels[1, column]
        xs = torch.linspace(-3.0, 3.0, 201, dtype=torch.float64)
        ys = torch.linspace(-3.5, 2.0, 201, dtype=torch.float64)
        energy = energy_grid(TWO_D[0], row["beta"], [xs, ys])
        supported = energy < 0.95 * energy.max()
        ax.contourf(xs.numpy(), ys.numpy(), np.where(supported, energy, np.nan), levels=20, cmap="viridis")
        _mark(ax, row, TWO_D[0], one_d=False)
        ax.set(title=f"2-D, beta = {row['beta']}", aspect="equal", xticks=[], yticks=[])
    fig.suptitle(
        "Log-sum-ReLU energy (Hoover et al., NeurIPS 2025, Fig. 1): certified minima from et_ode.find_attractor\n"
        "blue: preserved memories (at stored patterns), red: emergent memories, black: stored patterns; white: no support"
    )
    fig.savefig(path, dpi=90)


def _table(ax: object, rows: dict[int, list[dict[str, float]]]) -> None:
    """The counts, reference against measured, as a table in the empty panel."""
    cells = [
        [
            f"{d}-D",
            f"{row['beta']}",
            f"{row['preserved']} + {row['emergent']}",
            f"{row['found_preserved']} + {row['found'] - row['found_preserved']}",
        ]
        for d, table in rows.items()
        for row in table
    ]
    ax.axis("off")
    ax.table(cells, colLabels=["d", "beta", "Fig. 1", "certified"], loc="center").scale(1.0, 1.4)
    ax.set_title("minima: preserved + emergent")


def _mark(ax: object, row: dict[str, float], patterns: torch.Tensor, *, one_d: bool) -> None:
    points = np.array(row["points"]).reshape(-1, patterns.shape[1])
    stored = np.array([np.min(np.linalg.norm(patterns.numpy() - p, axis=1)) < 1e-3 for p in points], dtype=bool)
    if one_d:
        model = et_ode.EnergyModel(et_ode.IdentityNeuron(1), [LogSumReLU(patterns, row["beta"])])
        with torch.no_grad():
            energies = model.energy(torch.tensor(points)[:, None, :]).numpy() if len(points) else np.zeros(0)
        ax.scatter(points[stored, 0], energies[stored], marker="*", s=250, color="blue", zorder=5)
        ax.scatter(points[~stored, 0], energies[~stored], marker="*", s=250, color="red", zorder=5)
        ax.scatter(patterns[:, 0].numpy(), np.zeros(len(patterns)), color="black", transform=ax.get_xaxis_transform())
    else:
        ax.scatter(patterns[:, 0].numpy(), patterns[:, 1].numpy(), s=120, color="black", zorder=4)
        ax.scatter(points[stored, 0], points[stored, 1], marker="*", s=300, color="blue", edgecolors="white", zorder=5)
        ax.scatter(points[~stored, 0], points[~stored, 1], marker="*", s=300, color="red", edgecolors="white", zorder=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/guides/emergent_memories.png", help="the figure")
    parser.add_argument("--grid", type=int, default=41, help="starts per axis (1-D: this many, 2-D: its square)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {1: [compare(ONE_D[0], beta, args.grid) for beta in ONE_D[1]]}
    rows[2] = [compare(TWO_D[0], beta, max(args.grid // 2, 5)) for beta in TWO_D[1]]
    print(
        "d | beta | Fig. 1 (reference): preserved + emergent | certified: preserved + emergent | max |x - c_S| | "
        "max relative eigenvalue difference"
    )
    agree = True
    for d, table in rows.items():
        for row in table:
            emergent_found = row["found"] - row["found_preserved"]
            same = row["found"] == row["matched"] == row["preserved"] + row["emergent"]
            agree &= same and row["found_preserved"] == row["preserved"]
            print(
                f"{d} | {row['beta']} | {row['preserved']} + {row['emergent']} | {row['found_preserved']} + "
                f"{emergent_found} | {row['position_error']:.1e} | {row['eigenvalue_error']:.1e}"
            )
    print("counts match the paper's Fig. 1 in every panel" if agree else "counts DIFFER from the paper's Fig. 1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, out)
    print(f"figure: {out}")


if __name__ == "__main__":
    main()
