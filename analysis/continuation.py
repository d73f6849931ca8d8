"""Pseudo-arclength continuation of a critical point in one scalar parameter, with its bifurcations.

``family(mu)`` maps the parameter onto a field (an :class:`et_ode.ETField` or an :class:`et_ode.EnergyModel`):
``beta``, ``gamma``, a weight scale, anything. The branch ``F(x, mu) = 0``, ``F`` the Riemannian gradient in
the tangent frame at the state ``x`` on the flow's limit spheres (:mod:`et_ode.analysis.sphere`; the gradient of
``E(g(x))`` in ``x`` for a Euclidean neuron, :mod:`et_ode.analysis.chart`), is followed in arclength: a predictor
along the tangent ``(t_x, t_mu)`` (the null vector of ``[Hess_R, dF/dmu]``), then Newton on ``F = 0`` within the
hyperplane orthogonal to the tangent (Keller). ``dF/dmu`` is a central difference in
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

from et_ode import EnergyModel, ETField
from et_ode.analysis._tables import Table
from et_ode.analysis.chart import Chart, chart_for
from et_ode.analysis.plots import _finish
from et_ode.backend.validation import check_positive

PathLike = str | os.PathLike[str]
Family = Callable[[float], "ETField | EnergyModel"]


def _field(family: Family, mu: float) -> ETField:
    made = family(mu)
    if isinstance(made, EnergyModel):
        return ETField(made)
    if not isinstance(made, ETField):
        raise TypeError(f"family(mu) must return an ETField or an EnergyModel, got {type(made).__name__}")
    return made


def _chart(family: Family, mu: float) -> Chart:
    return chart_for(_field(family, mu))


@dataclass
class Bifurcation:
    """A zero crossing of a Hessian eigenvalue between branch points ``step - 1`` and ``step``.

    Attributes:
        kind: ``"fold"`` or ``"branch point"``.
        mu: the parameter of the crossing: a fold at the extremum of a parabola through three points of the
            branch (linear interpolation at its last point), a branch point by secant iterations on the crossing
            eigenvalue.
        step: the index of the branch point after the crossing.
        index_before: the Hessian index at point ``step - 1``.
        index_after: the Hessian index at point ``step``.
    """

    kind: str
    mu: float
    step: int
    index_before: int
    index_after: int


@dataclass
class Branch(Table):
    """The points of a continued branch.

    Attributes:
        mu: the parameters ``(P,)``.
        xs: the states ``(P, N, D)``, on the limit spheres.
        energies: the energies ``(P,)``.
        eigenvalues: the Riemannian Hessian's eigenvalues ``(P, n)``, ascending.
        indices: the Hessian indices ``(P,)``.
        bifurcations: the bifurcations found along the branch.
    """

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


def _parameter_derivative(family: Family, x: Tensor, mu: float, frame: Tensor, h: float) -> Tensor:
    with torch.no_grad():
        plus = _chart(family, mu + h).gradient(x).flatten()
        minus = _chart(family, mu - h).gradient(x).flatten()
    return frame.flatten(1) @ (plus - minus) / (2 * h)


def _energy(field_mu: ETField, x: Tensor) -> float:
    with torch.no_grad():
        return float(field_mu.energy(x))


@dataclass(frozen=True)
class ArcLength:
    """The settings of :func:`continue_branch`: steps of ``step`` in arclength, measured in ``(g, mu)`` (halved
    when Newton fails), at most ``max_points`` points, Newton to RMS ``|T dE/dg| <= tol``, ``dF/dmu`` by a central
    difference of ``difference`` in ``mu``.

    Attributes:
        step: the arclength per point, in ``(g, mu)``.
        max_points: points at most, at least 2.
        tol: RMS ``|T dE/dg|`` for Newton.
        difference: the step of the central difference in ``mu``.
        zero_tol: the relative size up to which an eigenvalue counts as zero (for the index).

    Raises:
        ValueError: ``step``, ``tol``, ``difference`` or ``zero_tol`` is not a positive number, or ``max_points`` not
            an integer of at least 2.
    """

    step: float = 0.05
    max_points: int = 200
    tol: float = 1e-10
    difference: float = 1e-6
    zero_tol: float = 1e-8

    def __post_init__(self) -> None:
        for name in ("step", "tol", "difference", "zero_tol"):
            check_positive(f"ArcLength.{name}", getattr(self, name))
        check_positive("ArcLength.max_points", self.max_points, integer=True)
        if self.max_points < 2:
            raise ValueError(f"ArcLength.max_points must be at least 2, got {self.max_points}")


def continue_branch(family: Family, x0: Tensor, mu0: float, *, mu_end: float, arclength: ArcLength = ArcLength()) -> Branch:
    """Follow the critical point at (near) ``x0`` ``(N, D)`` for ``family(mu0)``, starting toward ``mu_end``
    in steps of arclength, until ``mu`` leaves the interval between ``mu0`` and ``mu_end`` (on either side: past a
    fold the branch turns back), after ``arclength.max_points`` points, or when the step underflows. Fold
    locations: the extremum of ``mu`` along the branch (a parabola through three points); branch points: secant
    iterations on the crossing eigenvalue.

    Args:
        family: ``mu -> ETField`` (or an EnergyModel), the one-parameter family.
        x0: a state ``(N, D)`` at or near a critical point of ``family(mu0)``.
        mu0: the parameter to start at.
        mu_end: the parameter to head for.
        arclength: the step, the number of points and the Newton corrector's settings.

    Returns:
        The :class:`Branch`: its points, energies, spectra and bifurcations.

    Raises:
        ValueError: ``mu_end == mu0``, or ``x0`` is not near a critical point of ``family(mu0)``.
        TypeError: ``arclength`` is not an :class:`ArcLength`.
    """
    if not isinstance(arclength, ArcLength):
        raise TypeError(f"arclength must be an ArcLength(...), got {type(arclength).__name__}")
    if mu_end == mu0:
        raise ValueError("mu_end must differ from mu0")
    x = _chart(family, mu0).canonical(x0.detach())
    tracer = _Tracer(family, arclength, 1.0 if mu_end > mu0 else -1.0, math.sqrt(x.numel()))
    x, mu, ok = tracer.newton(x, mu0)
    if not ok:
        raise ValueError("x0 is not close to a critical point of family(mu0): Newton did not converge")
    points = tracer.follow(x, mu, (min(mu0, mu_end), max(mu0, mu_end)))
    mus = torch.tensor([p.mu for p in points], dtype=torch.float64)
    eigenvalues = torch.stack([p.eigenvalues for p in points]).to(torch.float64).cpu()
    scale = eigenvalues.abs().amax(dim=1, keepdim=True).clamp_min(1.0)
    indices = (eigenvalues < -arclength.zero_tol * scale).sum(dim=1)
    bifurcations = [
        tracer.bifurcation(points, mus, eigenvalues, k, (int(indices[k - 1]), int(indices[k])))
        for k in range(1, len(points))
        if int(indices[k]) != int(indices[k - 1])
    ]
    return Branch(
        mu=mus,
        xs=torch.stack([p.x for p in points]).cpu(),
        energies=torch.tensor([p.energy for p in points], dtype=torch.float64),
        eigenvalues=eigenvalues,
        indices=indices,
        bifurcations=bifurcations,
    )


@dataclass
class _Point:
    """A point of the branch: the parameter, the state, its energy, the Hessian's eigenvalues, and the mu component
    of the tangent there (its sign flips at a fold)."""

    mu: float
    x: Tensor
    energy: float
    eigenvalues: Tensor
    tangent_mu: float


Tangent = tuple[Tensor, float]  # the branch's tangent: its ambient g-direction (N, D) and its mu component


def _nearest_zero(eigenvalues: Tensor) -> float:
    """The eigenvalue of smallest magnitude."""
    return float(eigenvalues[eigenvalues.abs().argmin()])


@dataclass
class _Tracer:
    """The parts of one continuation of ``family``: Newton on ``F = 0``, the tangent at a point, the predictor-corrector
    walk along the branch, and the location of a bifurcation between two of its points."""

    family: Family
    arclength: ArcLength
    direction: float  # +1 toward larger mu at the start, -1 toward smaller
    size: float  # sqrt of the state's size: F's norm over it is the RMS tangent gradient

    def newton(self, x: Tensor, mu: float, tangent: Tangent | None = None) -> tuple[Tensor, float, bool]:
        """Newton on ``F = 0`` from ``(x, mu)``: within the arclength hyperplane through it orthogonal to ``tangent``,
        or at fixed ``mu`` without one. Returns the point and whether Newton converged."""
        anchor = (x, mu)
        for _ in range(30):
            field_mu = _field(self.family, mu)
            matrix, gradient, frame = chart_for(field_mu).hessian_in_frame(x)
            if float(gradient.norm()) / self.size < self.arclength.tol:
                return x, mu, True
            if tangent is None:
                change, dmu = torch.linalg.lstsq(matrix, -gradient[:, None]).solution[:, 0], 0.0
            else:
                change, dmu = self._bordered_step(field_mu, x, mu, (matrix, gradient, frame), tangent, anchor)
            if not bool(torch.isfinite(change).all()) or float(change.norm()) > 10 * self.arclength.step + 1.0:
                return x, mu, False
            x = chart_for(field_mu).retract(x, (change @ frame.flatten(1)).reshape(x.shape))
            mu = mu + dmu
        return x, mu, False

    def _bordered_step(
        self,
        field_mu: ETField,
        x: Tensor,
        mu: float,
        hessian: tuple[Tensor, Tensor, Tensor],
        tangent: Tangent,
        anchor: tuple[Tensor, float],
    ) -> tuple[Tensor, float]:
        """The Newton step in the frame's coordinates and in ``mu`` of the system ``F = 0`` bordered by the arclength
        condition (the distance from ``anchor`` along ``tangent`` is zero)."""
        matrix, gradient, frame = hessian
        ambient, tangent_mu = tangent
        derivative = _parameter_derivative(self.family, x, mu, frame, self.arclength.difference)
        tangent_x = frame.flatten(1) @ ambient.flatten()
        chart = chart_for(field_mu)
        offset = (chart.coordinates(x) - chart.coordinates(anchor[0])).detach().flatten() @ ambient.flatten()
        residual = float(offset) + (mu - anchor[1]) * tangent_mu
        bordered = torch.cat(
            [
                torch.cat([matrix, derivative[:, None]], dim=1),
                torch.cat([tangent_x, x.new_tensor([tangent_mu])])[None],
            ]
        )
        solution = torch.linalg.solve(bordered, -torch.cat([gradient, x.new_tensor([residual])]))
        return solution[:-1], float(solution[-1])

    def describe(self, x: Tensor, mu: float, previous: Tangent | None) -> tuple[Tangent, _Point]:
        """The tangent at the critical point ``(x, mu)`` (the null vector of ``[Hess_R, dF/dmu]``, oriented to continue
        ``previous``, or toward ``mu_end`` at the start) and the point."""
        field_mu = _field(self.family, mu)
        matrix, _, frame = chart_for(field_mu).hessian_in_frame(x)
        derivative = _parameter_derivative(self.family, x, mu, frame, self.arclength.difference)
        null = torch.linalg.svd(torch.cat([matrix, derivative[:, None]], dim=1)).Vh[-1]  # of the (n, n + 1) Jacobian
        ambient = (null[:-1] @ frame.flatten(1)).reshape(x.shape)
        if previous is None:
            sign = self.direction * (1.0 if float(null[-1]) >= 0 else -1.0)
        else:
            sign = 1.0 if float((ambient * previous[0]).sum() + null[-1] * previous[1]) >= 0 else -1.0
        tangent = (ambient * sign, float(null[-1] * sign))
        return tangent, _Point(mu, x, _energy(field_mu, x), torch.linalg.eigvalsh(matrix), tangent[1])

    def follow(self, x: Tensor, mu: float, interval: tuple[float, float]) -> list[_Point]:
        """Predictor (along the tangent) and corrector (:meth:`newton` in its hyperplane) from the critical point
        ``(x, mu)`` while ``mu`` stays in ``interval``, for at most ``arclength.max_points`` points."""
        low, high = interval
        tangent, point = self.describe(x, mu, None)
        points = [point]
        length = self.arclength.step
        while len(points) < self.arclength.max_points and low <= mu <= high and length > self.arclength.step * 1e-4:
            predicted = _chart(self.family, mu).retract(x, length * tangent[0])
            new_x, new_mu, ok = self.newton(predicted, mu + length * tangent[1], tangent)
            if not ok:
                length /= 2
                continue
            x, mu = new_x, new_mu
            tangent, point = self.describe(x, mu, tangent)
            points.append(point)
            length = min(self.arclength.step, length * 1.5)
        return points

    def bifurcation(
        self, points: list[_Point], mus: Tensor, eigenvalues: Tensor, k: int, indices: tuple[int, int]
    ) -> Bifurcation:
        """The bifurcation between points ``k - 1`` and ``k``, where the index changes from ``indices[0]`` to
        ``indices[1]``: a fold where the tangent's mu component changes sign, else a branch point."""
        fold = points[k].tangent_mu * points[k - 1].tangent_mu < 0
        if fold and k < len(points) - 1:  # the extremum of mu(s): a parabola through three points
            location = _parabola_extremum(mus[k - 1 : k + 2].tolist())
        else:
            before, after = _nearest_zero(eigenvalues[k - 1]), _nearest_zero(eigenvalues[k])
            location = float(mus[k - 1] + before / (before - after) * (mus[k] - mus[k - 1]))
        if not fold:  # a branch point lies on a smooth branch in mu: secant iterations on the eigenvalue
            start = (float(mus[k - 1]), _nearest_zero(eigenvalues[k - 1]), points[k - 1].x)
            end = (float(mus[k]), _nearest_zero(eigenvalues[k]), points[k].x)
            location = self._secant(start, end, location)
        kind = "fold" if fold else "branch point"
        return Bifurcation(kind=kind, mu=location, step=k, index_before=indices[0], index_after=indices[1])

    def _secant(self, start: tuple[float, float, Tensor], end: tuple[float, float, Tensor], location: float) -> float:
        """Secant iterations from ``start`` and ``end`` (``mu``, the eigenvalue nearest zero, the state) on the
        eigenvalue nearest zero at fixed ``mu``: the ``mu`` where it vanishes (``location`` if no step succeeds)."""
        bracket = [start, end]
        for _ in range(20):
            (mu_a, value_a, _), (mu_b, value_b, x_b) = bracket
            if value_a == value_b:
                break
            mu_next = mu_b - value_b * (mu_b - mu_a) / (value_b - value_a)
            x, _, ok = self.newton(x_b, mu_next)
            if not ok:
                break
            value = _nearest_zero(torch.linalg.eigvalsh(_chart(self.family, mu_next).hessian_in_frame(x)[0]))
            bracket = [bracket[1], (mu_next, value, x)]
            location = mu_next
            if abs(value) < 1e-12 or abs(mu_next - mu_b) < 1e-13:
                break
        return location


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
    (the colour gives the index), markers at the folds (triangles) and branch points (circles).

    Args:
        branches: the branches (:func:`continue_branch`).
        path, figsize, dpi: the file to save to (or None), the size in inches, the resolution.
        labels: one legend entry per branch, or None.
        parameter: the parameter's name on the axis.

    Returns:
        The figure of the diagram.
    """
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
    """A start on another branch near a branch point: ``x`` ``(N, D)`` moved ``offset`` (coordinate units: ``g`` on
    the spheres) along the tangent ``direction`` ``(N, D)`` (e.g. the Hessian's null eigenvector there), on the
    limit spheres (the chart's canonical state)."""
    chart = _chart(family, mu)
    x = chart.canonical(x)
    frame = chart.frame(x).flatten(1)
    along = (frame.T @ (frame @ direction.flatten())).reshape(x.shape)
    along = along / along.norm()
    return chart.retract(x, offset * along)
