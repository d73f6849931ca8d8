"""Critical points of any index of ``E`` on the product of spheres: Newton, minimum-mode following, a census.

Every search works on one state ``x`` ``(N, D)`` on the flow's limit spheres (radius ``gamma sqrt(D)``, placed by
:func:`et_ode.dynamics.manifold.to_limit_spheres`, as :func:`et_ode.find_attractor` places its points) in the
orthonormal tangent frame of dimension ``n = N (D - 2)``, with the dense Riemannian Hessian ``H`` (``n``
Hessian-vector products) and the Riemannian gradient ``grad`` (both in ``g`` units):

- :func:`newton_critical_point`: Newton on ``grad = 0`` with a trust region (a Levenberg-Marquardt step
  ``-(H^2 + mu I)^(-1) H grad``, accepted when it lowers ``|grad|``). It converges to the critical point
  near the start whatever its index (minima, saddles, maxima), unlike descent.
- :func:`saddle_from_minimum`: minimum-mode following (eigenvector following, partitioned rational-function
  steps): uphill along the Hessian's lowest mode, downhill along the others, from a minimum pushed along
  its softest mode; ends at an index-1 saddle, polished by Newton.
- :func:`census`: Newton (or descent) from many random starts; the critical points found, deduplicated
  modulo token permutations (an exact symmetry of the energy without a mask or positions), with their
  energies, indices and how often each is reached.

Distances between critical points are RMS per element in ``g`` (``(N, D)``). A neuron of Euclidean geometry is
searched in its chart (:mod:`et_ode.analysis.chart`): ``x`` and the Hessian of ``E(g(x))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from et_ode import ETField
from et_ode.analysis._tables import Table
from et_ode.analysis.chart import chart_for
from et_ode.backend.validation import check_positive
from et_ode.equilibrium.certify import check_lyapunov_neuron


@dataclass
class CriticalPoint:
    """A critical point of the energy on the limit spheres.

    Attributes:
        x: the state ``(N, D)``, on the limit spheres.
        energy: its energy.
        eigenvalues: the Riemannian Hessian's eigenvalues ``(n,)``, ascending, ``g`` units.
        index: the number of eigenvalues below ``-zero_tol``.
        rms_tangent_gradient: RMS ``|T dE/dg|`` at ``x``.
        converged: whether the search converged (``rms_tangent_gradient <= tol``).
        iterations: the Newton iterations the search took.
        lowest_mode: the unit eigenvector of the lowest eigenvalue as a ``g``-direction ``(N, D)`` (the unstable
            direction of an index-1 saddle).
    """

    x: Tensor
    energy: float
    eigenvalues: Tensor
    index: int
    rms_tangent_gradient: float
    converged: bool
    iterations: int
    lowest_mode: Tensor

    @property
    def kind(self) -> str:
        if self.index == 0:
            return "minimum" if bool((self.eigenvalues > 0).all()) else "degenerate minimum"
        return "maximum" if self.index == len(self.eigenvalues) else f"saddle (index {self.index})"


def _check_state(field: ETField, x: Tensor) -> Tensor:
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    if not (isinstance(x, Tensor) and x.is_floating_point() and x.dim() == 2 and x.shape[-1] == field.model.dim):
        raise ValueError(
            f"x must be one state (N, D) with D={field.model.dim}, got "
            f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}"
        )
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x has non-finite entries")
    check_lyapunov_neuron(field, "a critical-point search")
    return chart_for(field).canonical(x.detach())


def _describe(field: ETField, x: Tensor, iterations: int, tol: float, zero_tol: float) -> CriticalPoint:
    matrix, gradient, frame = chart_for(field).hessian_in_frame(x)
    values, vectors = torch.linalg.eigh(matrix)
    rms = float(gradient.norm()) / math.sqrt(x.numel())
    scale = float(values.abs().max()) if len(values) else 1.0
    with torch.no_grad():
        energy = float(field.energy(x))
    return CriticalPoint(
        x=x,
        energy=energy,
        eigenvalues=values,
        index=int((values < -zero_tol * max(scale, 1.0)).sum()),
        rms_tangent_gradient=rms,
        converged=rms <= tol,
        iterations=iterations,
        lowest_mode=(vectors[:, 0] @ frame.flatten(1)).reshape(x.shape),
    )


def _step_in_g(field: ETField, x: Tensor, frame: Tensor, coefficients: Tensor) -> Tensor:
    """The state on the limit spheres after moving ``g`` by ``frame^T coefficients`` (in the Euclidean chart, ``x``
    moved by it)."""
    return chart_for(field).retract(x, (coefficients @ frame.flatten(1)).reshape(x.shape))


def newton_critical_point(
    field: ETField, x: Tensor, *, tol: float = 1e-10, max_iter: int = 100, radius: float = 0.5, zero_tol: float = 1e-8
) -> CriticalPoint:
    """The critical point nearest (in the Newton sense) to ``x`` ``(N, D)``, of any index.

    Each iteration solves ``min |grad + H s|^2 + mu |s|^2`` in the tangent frame (``H``, ``grad``: Riemannian
    Hessian and gradient in ``g``), with ``mu`` the smallest making ``|s| <= radius``; a step is accepted when it
    lowers ``|grad|`` (then ``radius`` grows, else it halves).

    Args:
        field: the vector field.
        x: the start ``(N, D)``.
        tol: converged at RMS ``|T dE/dg| <= tol``.
        max_iter: Newton iterations at most.
        radius: the first trust radius.
        zero_tol: an eigenvalue ``|lambda| <= zero_tol * max |lambda|`` counts as zero (for the index).

    Returns:
        The :class:`CriticalPoint` (``converged`` says whether it met ``tol``).

    Raises:
        ValueError: a bad ``x``, or ``tol``, ``radius``, ``max_iter`` out of range.
    """
    x = _check_state(field, x)
    check_positive("tol", tol)
    check_positive("radius", radius)
    if isinstance(max_iter, bool) or not (isinstance(max_iter, int) and max_iter >= 0):
        raise ValueError(f"max_iter must be a non-negative integer, got {max_iter!r}")
    size = math.sqrt(x.numel())
    iterations = 0
    chart = chart_for(field)
    matrix, gradient, frame = chart.hessian_in_frame(x)
    while iterations < max_iter and float(gradient.norm()) / size > tol and radius > 1e-14:
        iterations += 1
        values, vectors = torch.linalg.eigh(matrix)
        along = vectors.T @ gradient
        mu = 0.0
        newton = -along * values / (values.square() + mu)
        if not bool(torch.isfinite(newton).all()) or float(newton.norm()) > radius:
            low, high = (
                0.0,
                float(values.abs().max()) ** 2 + float(gradient.norm()) / radius * float(values.abs().max() + 1.0),
            )
            for _ in range(60):  # bisection on mu for |s(mu)| = radius
                mu = (low + high) / 2
                length = float((along * values / (values.square() + mu)).norm())
                low, high = (mu, high) if length > radius else (low, mu)
            mu = high
            newton = -along * values / (values.square() + mu)
        trial = _step_in_g(field, x, frame, vectors @ newton)
        trial_matrix, trial_gradient, trial_frame = chart.hessian_in_frame(trial)
        if float(trial_gradient.norm()) < float(gradient.norm()):
            x, matrix, gradient, frame = trial, trial_matrix, trial_gradient, trial_frame
            radius *= 2.0
        else:
            radius *= 0.25
    return _describe(field, x, iterations, tol, zero_tol)


def saddle_from_minimum(
    field: ETField,
    x_min: Tensor,
    *,
    direction: int = 1,
    push: float = 0.05,
    radius: float = 0.1,
    tol: float = 1e-10,
    max_iter: int = 500,
    zero_tol: float = 1e-8,
) -> CriticalPoint:
    """An index-1 saddle reached from the minimum ``x_min`` ``(N, D)`` by minimum-mode following.

    Starts ``push`` (``g`` units) from the minimum along ``direction`` (+1 / -1) times its softest Hessian mode,
    then takes partitioned rational-function steps (at most ``radius`` long): the lowest mode of the current
    Hessian is maximised, every other minimised. Once the Hessian has one negative eigenvalue and the step
    falls below ``radius / 10``, :func:`newton_critical_point` polishes.

    Args:
        field: the vector field.
        x_min: the minimum ``(N, D)``.
        direction: +1 or -1, the side of the softest mode to leave along.
        push: the first displacement, in ``g`` units.
        radius: the longest step.
        tol, max_iter, zero_tol: as in :func:`newton_critical_point`.

    Returns:
        The :class:`CriticalPoint` reached; an index-1 saddle where ``converged`` and ``index == 1``.

    Raises:
        ValueError: a bad ``x_min``, ``direction`` not +1 or -1, or ``push``, ``radius`` not positive.
    """
    x = _check_state(field, x_min)
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, got {direction!r}")
    check_positive("push", push)
    check_positive("radius", radius)
    chart = chart_for(field)
    matrix, gradient, frame = chart.hessian_in_frame(x)
    values, vectors = torch.linalg.eigh(matrix)
    x = _step_in_g(field, x, frame, direction * push * vectors[:, 0])
    iterations = 0
    while iterations < max_iter:
        iterations += 1
        matrix, gradient, frame = chart.hessian_in_frame(x)
        values, vectors = torch.linalg.eigh(matrix)
        along = vectors.T @ gradient
        up = float(values[0]) / 2 + math.sqrt(float(values[0]) ** 2 / 4 + float(along[0]) ** 2)  # maximise mode 0
        rest = torch.diag(torch.cat([values[1:], values.new_zeros(1)]))
        rest[-1, :-1] = along[1:]
        rest[:-1, -1] = along[1:]
        down = float(torch.linalg.eigvalsh(rest)[0])  # minimise the rest (RFO shift, below values[1])
        step = torch.cat([-along[:1] / (values[:1] - up), -along[1:] / (values[1:] - down)])
        step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
        length = float(step.norm())
        if length > radius:
            step = step * (radius / length)
        x = _step_in_g(field, x, frame, vectors @ step)
        if float(values[0]) < 0 and (len(values) == 1 or float(values[1]) > 0) and length < radius / 10:
            break
    point = newton_critical_point(field, x, tol=tol, zero_tol=zero_tol, radius=radius)
    point.iterations += iterations
    return point


# -- identity modulo symmetries ----------------------------------------------------------------------------------


def point_distance(field: ETField, a: Tensor, b: Tensor, *, permutations: bool = True) -> float:
    """RMS ``g``-distance between two states.

    Args:
        field: the vector field.
        a, b: states ``(N, D)``.
        permutations: minimise over token permutations (the optimal assignment of ``b``'s tokens to ``a``'s, by the
            Hungarian method).

    Returns:
        The distance.
    """
    neuron = field.model.neuron
    with torch.no_grad():
        ga, gb = neuron(a), neuron(b)
    if not permutations:
        return float((ga - gb).square().mean().sqrt())
    from scipy.optimize import linear_sum_assignment

    cost = torch.cdist(ga.double(), gb.double()).square().cpu().numpy()
    rows, cols = linear_sum_assignment(cost)
    return math.sqrt(float(cost[rows, cols].sum()) / ga.numel())


def match_or_append(
    field: ETField, known: list[CriticalPoint], point: CriticalPoint, *, permutations: bool, match_tol: float
) -> int:
    """The index in ``known`` of the first point within ``match_tol`` of ``point`` (:func:`point_distance`),
    appending ``point`` when there is none."""
    for index, other in enumerate(known):
        if point_distance(field, other.x, point.x, permutations=permutations) < match_tol:
            return index
    known.append(point)
    return len(known) - 1


def permutation_symmetric(field: ETField) -> bool:
    """Whether permuting tokens is an exact symmetry of the field's energy (true without a mask)."""
    return field.mask is None


@dataclass
class CensusEntry:
    """One distinct critical point and how many starts reached it."""

    point: CriticalPoint
    count: int


@dataclass
class Census(Table):
    """Distinct critical points found by repeated searches.

    Attributes:
        entries: the distinct points and how many searches reached each, in ascending energy.
        starts: the number of searches.
        failed: the searches that did not converge.
        permutations: whether points are identified modulo token permutations.
        match_tol: the RMS ``g``-distance within which two points are one.
    """

    entries: list[CensusEntry]
    starts: int
    failed: int
    permutations: bool
    match_tol: float

    def table(self) -> str:
        lines = [
            f"{len(self.entries)} distinct critical points from {self.starts} searches ({self.failed} did not "
            f"converge); identified {'modulo token permutations' if self.permutations else 'exactly'} "
            f"(RMS g-distance < {self.match_tol:g}).",
            "",
            "| # | energy | kind | index | smallest / largest eigenvalue | RMS T dE/dg | reached by |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, entry in enumerate(self.entries):
            p = entry.point
            lines.append(
                f"| {i} | {p.energy:.6g} | {p.kind} | {p.index} | {float(p.eigenvalues[0]):.4g} / "
                f"{float(p.eigenvalues[-1]):.4g} | {p.rms_tangent_gradient:.2g} | {entry.count} |"
            )
        return "\n".join(lines)

    def points(self, index: int | None = None) -> list[CriticalPoint]:
        """The distinct points, all or those of one ``index``.

        Args:
            index: the Hessian index to keep (0: minima, 1: index-1 saddles), or None for all.

        Returns:
            The points, in ascending energy.
        """
        return [e.point for e in self.entries if index is None or e.point.index == index]


def deduplicate(
    field: ETField, points: list[CriticalPoint], *, match_tol: float = 1e-5, permutations: bool | None = None
) -> list[CensusEntry]:
    """Group points closer than ``match_tol``, counting the members of each group.

    Args:
        field: the vector field.
        points: the critical points.
        match_tol: the RMS ``g``-distance within which two points are one.
        permutations: compare modulo token permutations (None: when the energy has that symmetry).

    Returns:
        One :class:`CensusEntry` per group, in ascending energy.
    """
    permutations = permutation_symmetric(field) if permutations is None else permutations
    entries: list[CensusEntry] = []
    for point in points:
        for entry in entries:
            if point_distance(field, entry.point.x, point.x, permutations=permutations) < match_tol:
                entry.count += 1
                break
        else:
            entries.append(CensusEntry(point=point, count=1))
    return sorted(entries, key=lambda e: e.point.energy)


def census(
    field: ETField,
    starts: Tensor,
    *,
    descent: bool = True,
    tol: float = 1e-10,
    match_tol: float = 1e-5,
    max_iter: int = 100,
    progress: bool = False,
) -> Census:
    """The distinct critical points reached from the starts ``(S, N, D)``, with counts.

    From every start: Newton (which ends at a critical point of any index), and with ``descent`` also Riemannian
    gradient descent (:func:`~et_ode.analysis.stability.find_fixed_point`, which ends at minima) polished by
    Newton; so ``2 S`` searches in all.

    Args:
        field: the vector field.
        starts: start states ``(S, N, D)``.
        descent: also descend from every start.
        tol, max_iter: Newton's, as in :func:`newton_critical_point`.
        match_tol: the distance within which two points are one.
        progress: show a progress bar.

    Returns:
        The :class:`Census`: the distinct points, each with the number of searches that reached it.

    Raises:
        ValueError: ``starts`` is not a tensor ``(S, N, D)``.
    """
    from tqdm.auto import tqdm

    from et_ode.analysis.stability import find_fixed_point

    if not (isinstance(starts, Tensor) and starts.dim() == 3):
        raise ValueError(
            f"starts must be a tensor (S, N, D), got "
            f"{tuple(starts.shape) if isinstance(starts, Tensor) else type(starts).__name__}"
        )
    begins = list(starts)
    if descent:
        begins += list(find_fixed_point(field, starts, tol=1e-6, max_iter=2000).x)
    found, failed = [], 0
    for start in tqdm(begins, desc="critical points", disable=not progress, leave=False):
        point = newton_critical_point(field, start, tol=tol, max_iter=max_iter)
        if point.converged:
            found.append(point)
        else:
            failed += 1
    permutations = permutation_symmetric(field)
    return Census(
        entries=deduplicate(field, found, match_tol=match_tol, permutations=permutations),
        starts=len(begins),
        failed=failed,
        permutations=permutations,
        match_tol=match_tol,
    )
