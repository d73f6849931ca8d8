"""Pseudo-arclength continuation of a critical point in one scalar parameter, with its bifurcations.

``family(mu)`` maps the parameter onto a field (an :class:`et_ode.ETField` or an ``EnergyTransformer``):
``beta``, ``gamma``, a weight scale, anything. The branch ``F(x, mu) = 0``, ``F`` the Riemannian gradient in
the tangent frame at the unit-scale state ``x`` (:mod:`et_ode.analysis.sphere`), is followed in arclength:
a predictor along the tangent ``(t_x, t_mu)`` (the null vector of ``[Hess_R, dF/dmu]``), then Newton on
``F = 0`` within the hyperplane orthogonal to the tangent (Keller). ``dF/dmu`` is a central difference in
``mu`` at fixed ``x``.

Between consecutive points a zero crossing of a Hessian eigenvalue (the index changes) is classified by the
two standard test functions: the tangent's parameter component ``t_mu`` changes sign at a **fold** (the branch
turns back, two critical points meet); the determinant of the bordered Jacobian ``[[Hess_R, dF/dmu], [t^T]]``
changes sign while ``t_mu`` does not at a **branch point** (a pitchfork or transcritical bifurcation: another
branch crosses; the token-permutation and other exact symmetries make pitchforks common).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from et_ode import EnergyTransformer, ETField
from et_ode.analysis.plots import _finish
from et_ode.analysis.sphere import hessian_in_frame, tangent_frame
from et_ode.dynamics.manifold import retract, to_limit_spheres

PathLike = str | os.PathLike[str]
Family = Callable[[float], "ETField | EnergyTransformer"]


def _field(family: Family, mu: float) -> ETField:
    made = family(mu)
    if isinstance(made, EnergyTransformer):
        return ETField(made)
    if not isinstance(made, ETField):
        raise TypeError(f"family(mu) must return an ETField or an EnergyTransformer, got {type(made).__name__}")
    return made


@dataclass
class Bifurcation:
    """A zero crossing of a Hessian eigenvalue between branch points ``step - 1`` and ``step``, at about
    ``mu`` (linear interpolation of the crossing eigenvalue); ``kind``: ``"fold"`` or ``"branch point"``."""

    kind: str
    mu: float
    step: int
    index_before: int
    index_after: int


@dataclass
class Branch:
    """The points of a continued branch: parameters ``mu`` ``(P,)``, states ``xs`` ``(P, N, D)`` (on the limit spheres),
    ``energies`` ``(P,)``, Hessian ``eigenvalues`` ``(P, n)``, ``indices`` ``(P,)``, and the bifurcations found."""

    mu: Tensor
    xs: Tensor
    energies: Tensor
    eigenvalues: Tensor
    indices: Tensor
    bifurcations: list[Bifurcation] = field(default_factory=list)

    def table(self) -> str:
        lines = [
            f"{len(self.mu)} points, mu from {float(self.mu[0]):.4g} to {float(self.mu[-1]):.4g}.",
            "",
            "| bifurcation | mu | index before -> after |",
            "|---|---|---|",
        ]
        lines += [f"| {b.kind} | {b.mu:.6g} | {b.index_before} -> {b.index_after} |" for b in self.bifurcations]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _parameter_derivative(family: Family, x: Tensor, mu: float, frame: Tensor, h: float) -> Tensor:
    with torch.no_grad():
        plus = _field(family, mu + h).tangent_gradient(x).flatten()
        minus = _field(family, mu - h).tangent_gradient(x).flatten()
    return frame.flatten(1) @ (plus - minus) / (2 * h)


def _energy(field_mu: ETField, x: Tensor) -> float:
    with torch.no_grad():
        return float(field_mu.energy(x))


def _gamma(field_mu: ETField) -> Tensor:
    return field_mu.model.neuron.gamma.detach()


def continue_branch(
    family: Family,
    x0: Tensor,
    mu0: float,
    *,
    mu_end: float,
    step: float = 0.05,
    max_points: int = 200,
    tol: float = 1e-10,
    difference: float = 1e-6,
    zero_tol: float = 1e-8,
) -> Branch:
    """Follow the critical point at (near) ``x0`` ``(N, D)`` for ``family(mu0)``, starting toward ``mu_end``
    (arclength ``step`` per point, measured in ``(g, mu)``; halved when Newton fails), until ``mu`` leaves the
    interval between ``mu0`` and ``mu_end`` (on either side: past a fold the branch turns back), after
    ``max_points`` points, or when the step underflows. Fold locations: the extremum of ``mu`` along the
    branch (a parabola through three points); branch points: secant iterations on the crossing eigenvalue.

    ``tol``: RMS ``|T dE/dg|`` for Newton; ``difference``: the step of the central difference in ``mu``.
    """
    if not (step > 0 and difference > 0 and isinstance(max_points, int) and max_points >= 2):
        raise ValueError(
            f"step and difference must be positive and max_points an integer >= 2, got step={step}, "
            f"difference={difference}, max_points={max_points}"
        )
    if mu_end == mu0:
        raise ValueError("mu_end must differ from mu0")
    direction = 1.0 if mu_end > mu0 else -1.0
    field0 = _field(family, mu0)
    x = to_limit_spheres(x0.detach(), field0.model.neuron.eps)
    size = math.sqrt(x.numel())

    def solve_at(
        x: Tensor, mu: float, tangent_ambient: Tensor | None, tangent_mu: float, anchor: tuple[Tensor, float]
    ) -> tuple[Tensor, float, bool]:
        """Newton on F = 0 (with the arclength hyperplane when a tangent is given; else at fixed mu)."""
        for _ in range(30):
            field_mu = _field(family, mu)
            matrix, gradient, frame = hessian_in_frame(field_mu, x)
            if float(gradient.norm()) / size < tol:
                return x, mu, True
            if tangent_ambient is None:
                solution = torch.linalg.lstsq(matrix, -gradient[:, None]).solution[:, 0]
                change, dmu = solution, 0.0
            else:
                derivative = _parameter_derivative(family, x, mu, frame, difference)
                tangent_x = frame.flatten(1) @ tangent_ambient.flatten()
                neuron = field_mu.model.neuron
                offset = (neuron(x) - neuron(anchor[0])).detach().flatten() @ tangent_ambient.flatten()
                residual = float(offset) + (mu - anchor[1]) * tangent_mu
                bordered = torch.cat(
                    [
                        torch.cat([matrix, derivative[:, None]], dim=1),
                        torch.cat([tangent_x, x.new_tensor([tangent_mu])])[None],
                    ]
                )
                rhs = -torch.cat([gradient, x.new_tensor([residual])])
                solution = torch.linalg.solve(bordered, rhs)
                change, dmu = solution[:-1], float(solution[-1])
            if not bool(torch.isfinite(change).all()) or float(change.norm()) > 10 * step + 1.0:
                return x, mu, False
            x = retract(x, (change @ frame.flatten(1)).reshape(x.shape), _gamma(field_mu), field_mu.model.neuron.eps)
            mu = mu + dmu
        return x, mu, False

    x, mu, ok = solve_at(x, mu0, None, 0.0, (x, mu0))
    if not ok:
        raise ValueError("x0 is not close to a critical point of family(mu0): Newton did not converge")

    def describe(x: Tensor, mu: float, previous: tuple[Tensor, float] | None) -> tuple[Tensor, float, Tensor, float, float]:
        """(tangent as ambient g-direction, its mu component, eigenvalues, bordered determinant sign, energy);
        ``previous``: the last tangent and its mu component, which the new one must continue (None: the first)."""
        field_mu = _field(family, mu)
        matrix, _, frame = hessian_in_frame(field_mu, x)
        derivative = _parameter_derivative(family, x, mu, frame, difference)
        jacobian = torch.cat([matrix, derivative[:, None]], dim=1)  # (n, n + 1)
        null = torch.linalg.svd(jacobian).Vh[-1]
        ambient = (null[:-1] @ frame.flatten(1)).reshape(x.shape)
        if previous is None:
            sign = direction * (1.0 if float(null[-1]) >= 0 else -1.0)
        else:
            sign = 1.0 if float((ambient * previous[0]).sum() + null[-1] * previous[1]) >= 0 else -1.0
        null = null * sign
        ambient = ambient * sign
        bordered = torch.cat([jacobian, null[None]])
        determinant_sign = float(torch.linalg.slogdet(bordered).sign)
        return ambient, float(null[-1]), torch.linalg.eigvalsh(matrix), determinant_sign, _energy(field_mu, x)

    tangent, tangent_mu, values, det_sign, energy = describe(x, mu, None)
    points = [(mu, x, energy, values, tangent_mu, det_sign)]
    length = step
    low, high = min(mu0, mu_end), max(mu0, mu_end)
    while len(points) < max_points and low <= mu <= high and length > step * 1e-4:
        field_mu = _field(family, mu)
        predicted = retract(x, length * tangent, _gamma(field_mu), field_mu.model.neuron.eps)
        mu_predicted = mu + length * tangent_mu
        new_x, new_mu, ok = solve_at(predicted, mu_predicted, tangent, tangent_mu, (predicted, mu_predicted))
        if not ok:
            length /= 2
            continue
        x, mu = new_x, new_mu
        tangent, tangent_mu, values, det_sign, energy = describe(x, mu, (tangent, tangent_mu))
        points.append((mu, x, energy, values, tangent_mu, det_sign))
        length = min(step, length * 1.5)
    mus = torch.tensor([p[0] for p in points], dtype=torch.float64)
    eigenvalues = torch.stack([p[3] for p in points]).to(torch.float64).cpu()
    scale = eigenvalues.abs().amax(dim=1, keepdim=True).clamp_min(1.0)
    indices = (eigenvalues < -zero_tol * scale).sum(dim=1)

    def smallest_at(mu: float, start: Tensor) -> tuple[float, Tensor] | None:
        """The eigenvalue of smallest magnitude at the critical point near ``start`` for fixed ``mu``."""
        x, _, ok = solve_at(start, mu, None, 0.0, (start, mu))
        if not ok:
            return None
        matrix, _, _ = hessian_in_frame(_field(family, mu), x)
        values = torch.linalg.eigvalsh(matrix)
        return float(values[values.abs().argmin()]), x

    bifurcations = []
    for k in range(1, len(points)):
        if int(indices[k]) == int(indices[k - 1]):
            continue
        fold = points[k][4] * points[k - 1][4] < 0
        if fold and 1 <= k < len(points) - 1:  # the extremum of mu(s): a parabola through three points
            location = _parabola_extremum(mus[k - 1 : k + 2].tolist())
        else:
            before, after = (float(v[v.abs().argmin()]) for v in (eigenvalues[k - 1], eigenvalues[k]))
            location = float(mus[k - 1] + before / (before - after) * (mus[k] - mus[k - 1]))
        if not fold:  # a branch point lies on a smooth branch in mu: secant iterations on the eigenvalue
            bracket = [
                (float(mus[k - 1]), float(eigenvalues[k - 1][eigenvalues[k - 1].abs().argmin()]), points[k - 1][1]),
                (float(mus[k]), float(eigenvalues[k][eigenvalues[k].abs().argmin()]), points[k][1]),
            ]
            for _ in range(20):
                (mu_a, value_a, _), (mu_b, value_b, x_b) = bracket
                if value_a == value_b:
                    break
                mu_next = mu_b - value_b * (mu_b - mu_a) / (value_b - value_a)
                evaluated = smallest_at(mu_next, x_b)
                if evaluated is None:
                    break
                bracket = [bracket[1], (mu_next, evaluated[0], evaluated[1])]
                location = mu_next
                if abs(evaluated[0]) < 1e-12 or abs(mu_next - mu_b) < 1e-13:
                    break
        bifurcations.append(
            Bifurcation(
                kind="fold" if fold else "branch point",
                mu=location,
                step=k,
                index_before=int(indices[k - 1]),
                index_after=int(indices[k]),
            )
        )
    return Branch(
        mu=mus,
        xs=torch.stack([p[1] for p in points]).cpu(),
        energies=torch.tensor([p[2] for p in points], dtype=torch.float64),
        eigenvalues=eigenvalues,
        indices=indices,
        bifurcations=bifurcations,
    )


def _parabola_extremum(values: list[float]) -> float:
    """The extremum of the parabola through ``(0, v0), (1, v1), (2, v2)`` (the middle value when it is a line)."""
    v0, v1, v2 = values
    curvature = v0 - 2 * v1 + v2
    if curvature == 0:
        return v1
    s = 1.0 + (v0 - v2) / (2 * curvature)
    return v0 + s * (v1 - v0) + s * (s - 1) / 2 * curvature


def plot_bifurcation_diagram(
    branches: list[Branch],
    *,
    labels: list[str] | None = None,
    parameter: str = "mu",
    path: PathLike | None = None,
    figsize: tuple[float, float] = (8.0, 5.0),
    dpi: int = 100,
) -> Figure:
    """Energy against the parameter for every branch: solid where a minimum (index 0), dashed where a saddle
    (the colour gives the index), markers at the folds (triangles) and branch points (circles)."""
    from matplotlib import colormaps

    labels = labels or [f"branch {i}" for i in range(len(branches))]
    if len(labels) != len(branches):
        raise ValueError(f"labels must have one entry per branch ({len(branches)}), got {len(labels)}")
    top = max(int(b.indices.max()) for b in branches) if branches else 0
    cmap = colormaps["viridis"]
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    seen: set[int] = set()
    for branch, name in zip(branches, labels, strict=True):
        mu, energy, index = branch.mu.numpy(), branch.energies.numpy(), branch.indices.numpy()
        for k in range(1, len(mu)):
            level = int(index[k])
            ax.plot(
                mu[k - 1 : k + 1],
                energy[k - 1 : k + 1],
                color=cmap(level / max(top, 1)),
                linestyle="-" if level == 0 else "--",
                linewidth=2,
                label=f"index {level}" if level not in seen else None,
            )
            seen.add(level)
        for b in branch.bifurcations:
            e = float(np.interp(b.mu, mu, energy)) if mu[0] < mu[-1] else float(energy[b.step])
            ax.scatter([b.mu], [e], marker="^" if b.kind == "fold" else "o", s=70, color="red", zorder=5, edgecolors="black")
            ax.annotate(
                f"{b.kind} ({name})\n{parameter} = {b.mu:.4g}",
                (b.mu, e),
                textcoords="offset points",
                xytext=(8, 8),
                fontsize="small",
            )
    ax.set(
        xlabel=parameter,
        ylabel="energy E at the critical point",
        title="Bifurcation diagram: critical points continued in "
        + parameter
        + "\nsolid: minimum, dashed: saddle (colour: index)",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _finish(fig, path, dpi)


def branch_from(family: Family, mu: float, x: Tensor, direction: Tensor, *, offset: float = 1e-2) -> Tensor:
    """A start on another branch near a branch point: ``x`` ``(N, D)`` moved ``offset`` (``g`` units) along the
    tangent ``direction`` ``(N, D)`` (e.g. the Hessian's null eigenvector there), on the limit spheres."""
    field_mu = _field(family, mu)
    x = to_limit_spheres(x, field_mu.model.neuron.eps)
    frame = tangent_frame(x).flatten(1)
    along = (frame.T @ (frame @ direction.flatten())).reshape(x.shape)
    along = along / along.norm()
    return retract(x, offset * along, _gamma(field_mu), field_mu.model.neuron.eps)
