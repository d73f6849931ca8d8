"""Stability of fixed points: the Riemannian Hessian's spectrum and the Jacobian of the g-dynamics.

Near a critical point ``g*`` the tangent dynamics of ``g`` is ``d(dg)/dt = J dg``, ``J = -(1/tau) Lambda Hess_R``,
which has the inertia of ``-Hess_R``: the point is classified from the Riemannian Hessian on the tangent space (the
two zero modes of every token left out) as a stable attractor, a saddle, a maximum or degenerate; the analysis guide
gives the derivation. Small systems get exact dense matrices by ``torch.func`` (``riemannian_hessian_matrix``,
``g_jacobian``), large ones the extreme eigenvalues by Lanczos or power iteration on Hessian-vector products
(:mod:`et_ode.analysis.eigensolvers`); ``operator_stability`` takes any symmetric operator ``w -> A w``.
``find_fixed_point`` descends on the spheres (:func:`et_ode.find_attractor`). Points are placed on the flow's limit
spheres of radius ``gamma sqrt(D)`` (:func:`~et_ode.dynamics.manifold.to_limit_spheres`). The dynamics near a point
are measured by :mod:`et_ode.analysis.exponents` and :mod:`et_ode.analysis.basin_probes`.

A neuron of Euclidean geometry is analysed in its chart (:mod:`et_ode.analysis.chart`): the Hessian of
``E(g(x))`` in ``x`` and the rates of ``-(1/tau) M^(1/2) H M^(1/2)``.

Shapes: states ``x`` are ``(B, N, D)`` (a single ``(N, D)`` is treated as ``B = 1``); vectors acted on
by operators have the shape of the state; dot products are per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from et_ode import Attractor, ETField, find_attractor
from et_ode.analysis._tables import Table, record
from et_ode.analysis.chart import Chart, chart_for
from et_ode.analysis.eigensolvers import Operator, dense_eigenvalues, extreme_eigenvalues
from et_ode.analysis.sphere import tangent_basis
from et_ode.dynamics.manifold import radial_direction
from et_ode.energy.neurons import sphere_neuron

CLASSES = ("stable attractor", "saddle", "maximum", "degenerate")


def batched_states(x: Tensor, field: ETField | None = None, name: str = "x") -> Tensor:
    """``x`` checked (a finite floating tensor ``(B, N, D)`` or ``(N, D)``, ``D`` the model's when ``field`` is given)
    and returned detached as ``(B, N, D)``; TypeError or ValueError naming ``name`` otherwise."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(
            f"{name} must be a floating torch.Tensor of shape (B, N, D) or (N, D), got "
            f"{type(x).__name__ if not isinstance(x, Tensor) else x.dtype}"
        )
    if x.dim() == 2:
        x = x[None]
    if x.dim() != 3 or (field is not None and x.shape[-1] != field.model.dim):
        expected = "D" if field is None else f"D={field.model.dim}"
        raise ValueError(f"{name} must have shape (B, N, {expected}) or (N, {expected}), got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} has non-finite entries")
    return x.detach()


def classify(smallest: float, largest: float, *, zero_tol: float) -> str:
    """One of :data:`CLASSES` from the extreme eigenvalues of a Hessian on the space of interest.

    Args:
        smallest, largest: the extreme eigenvalues.
        zero_tol: the size up to which an eigenvalue counts as zero.

    Returns:
        ``"stable attractor"``, ``"saddle"``, ``"maximum"`` or ``"degenerate"``.
    """
    if smallest > zero_tol:
        return "stable attractor"
    if smallest < -zero_tol:
        return "maximum" if largest < -zero_tol else "saddle"
    return "degenerate"


# -- the ET's tangent space ---------------------------------------------------------------------------------------


def tangent_rates(field: ETField, x: Tensor) -> Tensor:
    """``gamma / sigma_A`` per token, ``(B, N, 1)``: the tangential eigenvalue of ``M`` at the states ``x`` (the
    LayerNorm neuron's)."""
    neuron = sphere_neuron(field.model.neuron, "tangent_rates")
    sigma = (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1, keepdim=True).add(neuron.eps).sqrt()
    return neuron.gamma.detach() / sigma


def riemannian_hessian_matrix(field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
    """The dense Riemannian Hessian of ``E`` at ``g = LayerNorm(x)`` in :func:`tangent_basis`, exact.

    Built from the full Euclidean Hessian of ``E(g)`` (``torch.func.hessian`` of the field's ``energy_g``,
    ``(ND)^2`` entries per sample): ``Q^T H Q - diag((s_A . dE/dg_A) / r_A)``.

    Args:
        field: the vector field (LayerNorm neuron).
        x: states ``(B, N, D)`` or ``(N, D)``.

    Returns:
        ``(matrix (B, n, n), basis (B, n, N, D))``.

    Raises:
        ValueError: the neuron is not of geometry ``"spheres"``.
    """
    x = batched_states(x, field)
    delta = sphere_neuron(field.model.neuron, "riemannian_hessian_matrix").delta.detach()
    with torch.no_grad():
        g = field.model.neuron(x)
        dE_dg = field.dE_dg(g)
    s, radius = radial_direction(g, delta)
    basis = tangent_basis(g, delta)
    d = x.shape[-1]
    matrices = []
    for b in range(x.shape[0]):
        hessian = torch.func.hessian(field.select(b).energy_g)(g[b].detach())
        size = g[b].numel()
        q = basis[b].reshape(-1, size)
        curvature = ((dE_dg[b] * s[b]).sum(dim=-1) / radius[b, :, 0]).repeat_interleave(d - 2)
        matrices.append(q @ hessian.detach().reshape(size, size) @ q.T - torch.diag(curvature))
    return torch.stack(matrices), basis


def g_jacobian(field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
    """The exact Jacobian of the coordinates' dynamics on the tangent space at ``x``, ``(B, n, n)``, and the basis
    ``(B, n, N, D)`` (:mod:`et_ode.analysis.chart`: ``g`` on the spheres, ``x`` for a Euclidean neuron).

    ``torch.func.jacrev`` of ``x -> dg/dt = M(x) f(x)`` (``dx/dt = f(x)`` in the Euclidean chart; the field on its
    ``backend="reference"`` closed form, which ``torch.func`` can trace); a tangent change ``w`` of the coordinates
    is produced by ``dx = (sigma_A / gamma) w`` on the spheres (``dx = w`` in the Euclidean chart), so
    ``J = Q^T (d(dg/dt)/dx) Q diag(sigma_A / gamma)``. Its eigenvalues are the local rates ``exp(lambda t)`` of the
    motion of the coordinates at this state (``Re lambda < 0``: decay).

    Args:
        field: the vector field.
        x: states ``(B, N, D)`` or ``(N, D)``.

    Returns:
        ``(J (B, n, n), basis (B, n, N, D))``.
    """
    chart = chart_for(field)
    x = batched_states(x, field)
    basis = chart.basis(x)
    matrices = []
    for b in range(x.shape[0]):
        closed_form = ETField(field.model, field.tau, mask=field.select(b).mask, backend="reference")

        def rate(xb: Tensor, closed_form: ETField = closed_form) -> Tensor:
            return chart.velocity(closed_form, xb)

        jac = torch.func.jacrev(rate)(x[b])
        size = x[b].numel()
        q = basis[b].reshape(-1, size)
        moved = chart.displacement(x[b].expand_as(basis[b]), basis[b]).reshape(-1, size)
        matrices.append(q @ jac.detach().reshape(size, size) @ moved.T)
    return torch.stack(matrices), basis


def _dense_hessian(chart: Chart, field: ETField, x: Tensor) -> Tensor:
    """The exact Hessian in the chart's basis at every state of ``x`` ``(B, N, D)``, ``(B, n, n)``: the Riemannian
    Hessian on the spheres (:func:`riemannian_hessian_matrix`), the Hessian of ``E(g(x))`` (``torch.func.hessian``)
    in the Euclidean chart."""
    if chart.name == "spheres":
        return riemannian_hessian_matrix(field, x)[0]
    basis = chart.basis(x)
    matrices = []
    for b in range(x.shape[0]):
        hessian = torch.func.hessian(field.select(b).energy)(x[b].detach())
        q = basis[b].reshape(-1, x[b].numel())
        matrices.append(q @ hessian.detach().reshape(x[b].numel(), -1) @ q.T)
    return torch.stack(matrices)


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class SampleStability:
    """The spectrum at one sample's point.

    Attributes:
        sample: the sample's index in the batch.
        kind: the classification (:func:`classify`): ``"stable attractor"``, ``"saddle"``, ``"maximum"`` or
            ``"degenerate"``.
        smallest: the smallest eigenvalue of ``Hess_R`` (intrinsic curvature, units of energy per ``g``^2).
        largest: its largest eigenvalue.
        negative: the number of eigenvalues below the zero tolerance's negative, or None when not computed densely.
        rate_slowest: the slowest eigenvalue of the g-Jacobian at this state (per unit time; negative decays).
        rate_fastest: its fastest eigenvalue.
        rms_tangent_gradient: RMS ``|T dE/dg|`` (``nan`` where not measured).
        critical: the point is critical (``rms_tangent_gradient <= critical_tol``, or by assumption).
        residual: the eigensolver's residual bound (0 when dense, ``nan`` for power iteration).
        eigenvalues: all of ``Hess_R``'s eigenvalues, ascending, when computed densely; else None.
    """

    sample: int
    kind: str
    smallest: float
    largest: float
    negative: int | None
    rate_slowest: float
    rate_fastest: float
    rms_tangent_gradient: float
    critical: bool
    residual: float
    eigenvalues: list[float] | None = None


@dataclass
class StabilityReport(Table):
    """The spectra of a batch of points.

    Attributes:
        samples: one :class:`SampleStability` per sample.
        method: the eigensolver: ``"dense"``, ``"lanczos"`` or ``"power"``.
        dimension: the dimension of the space of the spectrum, per sample.
        zero_tol: the largest zero tolerance of the samples (an eigenvalue up to it counts as zero).
        settings: the solver's settings (tolerances, iterations).
        spheres: the space is the LayerNorm neuron's tangent space (False: a Euclidean neuron's chart, in ``x``).
    """

    samples: list[SampleStability]
    method: str
    dimension: int
    zero_tol: float
    settings: dict = field(default_factory=dict)
    spheres: bool = True  # the LayerNorm neuron's tangent space (else a Euclidean neuron's chart, in x)

    def table(self) -> str:
        space = (
            f"Riemannian Hessian on the tangent space (dimension {self.dimension} per sample, the all-ones and "
            "radial zero modes of every token excluded)"
            if self.spheres
            else f"Hessian of E(g(x)) in x (dimension {self.dimension} per sample)"
        )
        lines = [
            f"{space}, method: {self.method}; |lambda| <= {self.zero_tol:.2g} counts as zero.",
            "",
            "| sample | classification | smallest eigenvalue | largest eigenvalue | negative | "
            "slowest / fastest rate of g (1/time) | RMS T dE/dg | critical point |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for s in self.samples:
            negative = "?" if s.negative is None else str(s.negative)
            lines.append(
                f"| {s.sample} | {s.kind} | {s.smallest:.6g} | {s.largest:.6g} | {negative} | "
                f"{s.rate_slowest:.3g} / {s.rate_fastest:.3g} | {s.rms_tangent_gradient:.3g} | "
                f"{'yes' if s.critical else 'no'} |"
            )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return record(self, left_out=("spheres",))


def _zero_tol(smallest: Tensor, largest: Tensor, rel_tol: float, abs_tol: float) -> Tensor:
    return rel_tol * torch.maximum(smallest.abs(), largest.abs()) + abs_tol


def _samples(
    spectrum: tuple[Tensor, Tensor, Tensor],
    eigenvalues: Tensor | None,
    tol: Tensor,
    rates: tuple[Tensor, Tensor],
    gradient: tuple[Tensor, float] | None = None,
) -> list[SampleStability]:
    """One :class:`SampleStability` per sample from ``spectrum`` (smallest and largest eigenvalue, residual, each
    ``(B,)``), all ``eigenvalues`` ``(B, dim)`` or None, the zero tolerance ``tol`` ``(B,)``, the ``rates`` (slowest,
    fastest, ``(B,)``) and ``gradient`` (RMS tangent gradient ``(B,)`` and the ``critical_tol`` it is held to; None:
    a critical point by assumption)."""
    smallest, largest, residual = spectrum
    samples = []
    for b in range(smallest.shape[0]):
        rms = math.nan if gradient is None else float(gradient[0][b])
        samples.append(
            SampleStability(
                sample=b,
                kind=classify(float(smallest[b]), float(largest[b]), zero_tol=float(tol[b])),
                smallest=float(smallest[b]),
                largest=float(largest[b]),
                negative=None if eigenvalues is None else int((eigenvalues[b] < -tol[b]).sum()),
                rate_slowest=float(rates[0][b]),
                rate_fastest=float(rates[1][b]),
                rms_tangent_gradient=rms,
                critical=gradient is None or rms <= gradient[1],
                residual=float(residual[b]),
                eigenvalues=None if eigenvalues is None else eigenvalues[b].tolist(),
            )
        )
    return samples


def operator_stability(
    apply: Operator,
    like: Tensor,
    *,
    method: str = "auto",
    project: Operator | None = None,
    basis: Tensor | None = None,
    iterations: int = 80,
    max_dense: int = 400,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    seed: int = 0,
) -> StabilityReport:
    """Classify the critical point(s) of a generic energy from its symmetric Hessian operator.

    ``apply`` acts per sample on ``(B, ...)`` tensors shaped like ``like``. ``method``: ``"dense"`` (all
    eigenvalues, on ``basis`` or the standard basis), ``"lanczos"``, ``"power"`` or ``"auto"`` (dense up
    to ``max_dense`` dimensions). An eigenvalue counts as zero when ``|lambda| <= rel_tol max|lambda| + abs_tol``.
    Rates are reported as ``-lambda`` (gradient flow ``dg/dt = -A g``).

    Args:
        apply: the Hessian-vector product, ``(B, ...) -> (B, ...)``.
        like: a tensor ``(B, ...)`` of the operator's shape, dtype and device.
        method: ``"auto"``, ``"dense"``, ``"lanczos"`` or ``"power"``.
        project: the projector onto the space the operator acts on (Lanczos, power), or None.
        basis: an orthonormal basis ``(B, dim, ...)`` of that space for ``"dense"``, or None (the standard one).
        iterations: Lanczos or power iterations.
        max_dense: the largest dimension ``"auto"`` treats densely.
        rel_tol, abs_tol: the zero tolerance of an eigenvalue.
        seed: the start vector of the iterations.

    Returns:
        A :class:`StabilityReport`, one :class:`SampleStability` per sample.

    Raises:
        ValueError: ``like`` has no sample dimension, or ``method`` is unknown.
    """
    if not isinstance(like, Tensor) or like.dim() < 2:
        raise ValueError(
            f"like must be a tensor (B, ...) with a leading sample dimension, got "
            f"{tuple(like.shape) if isinstance(like, Tensor) else type(like).__name__}"
        )
    dimension = like[0].numel() if basis is None else basis.shape[1]
    method = ("dense" if dimension <= max_dense else "lanczos") if method == "auto" else method
    eigenvalues = None
    if method == "dense":
        eigenvalues = dense_eigenvalues(apply, like, basis=basis)
        smallest, largest = eigenvalues[:, 0], eigenvalues[:, -1]
        residual = torch.zeros_like(smallest)
    elif method in ("lanczos", "power"):
        smallest, largest, residual = extreme_eigenvalues(
            apply, like, method=method, iterations=iterations, project=project, seed=seed
        )
    else:
        raise ValueError(f"method must be 'auto', 'dense', 'lanczos' or 'power', got {method!r}")
    tol = _zero_tol(smallest, largest, rel_tol, abs_tol)
    return StabilityReport(
        samples=_samples((smallest, largest, residual), eigenvalues, tol, (-smallest, -largest)),
        method=method,
        dimension=dimension,
        zero_tol=float(tol.max()),
        settings={"rel_tol": rel_tol, "abs_tol": abs_tol, "iterations": iterations},
    )


def fixed_point_stability(
    field: ETField,
    x: Tensor,
    *,
    method: str = "auto",
    iterations: int = 80,
    max_dense: int = 300,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    critical_tol: float = 1e-4,
    seed: int = 0,
) -> StabilityReport:
    """Classify the state(s) ``x`` (``(B, N, D)`` or ``(N, D)``), normally a converged one.

    ``method``: ``"dense"`` (exact: ``torch.func`` Hessian of ``E``, and the Jacobian of the coordinates' dynamics
    for the rates), ``"lanczos"`` / ``"power"`` (extreme eigenvalues from Hessian-vector products of
    :func:`et_ode.dynamics.manifold.riemannian_hessian`, or of ``euclidean_hessian`` for a Euclidean neuron),
    ``"auto"`` (dense up to ``max_dense`` tangent dimensions). ``critical`` is reported per sample: RMS of the
    gradient (``T dE/dg`` on the spheres) ``<= critical_tol``; away from a critical point the classification
    describes the local curvature only.

    Args:
        field: the vector field.
        x: states ``(B, N, D)`` or ``(N, D)``.
        method: ``"auto"``, ``"dense"``, ``"lanczos"`` or ``"power"``.
        iterations: Lanczos or power iterations.
        max_dense: the largest tangent dimension ``"auto"`` treats densely.
        rel_tol, abs_tol: the zero tolerance of an eigenvalue, ``rel_tol max|lambda| + abs_tol``.
        critical_tol: the RMS gradient up to which a sample counts as critical.
        seed: the start vector of the iterations.

    Returns:
        A :class:`StabilityReport`, one :class:`SampleStability` per sample.

    Raises:
        ValueError: ``method`` is unknown, or ``x`` is not a valid state of the model.
    """
    chart = chart_for(field)
    x = batched_states(x, field)
    batch, n, d = x.shape
    dimension = chart.dimension(n)
    method = ("dense" if dimension <= max_dense else "lanczos") if method == "auto" else method
    if method not in ("dense", "lanczos", "power"):
        raise ValueError(f"method must be 'auto', 'dense', 'lanczos' or 'power', got {method!r}")
    apply, gradient = chart.hessian(x)
    rms_tangent_gradient = gradient.square().mean(dim=(-1, -2)).sqrt()
    project = chart.projector(x)

    eigenvalues = None
    if method == "dense":
        matrix = _dense_hessian(chart, field, x)
        eigenvalues = torch.linalg.eigvalsh((matrix + matrix.transpose(1, 2)) / 2)
        smallest, largest = eigenvalues[:, 0], eigenvalues[:, -1]
        jacobian, _ = g_jacobian(field, x)
        rate_values = torch.linalg.eigvals(jacobian).real
        rate_slowest, rate_fastest = rate_values.max(dim=1).values, rate_values.min(dim=1).values
        residual = torch.zeros_like(smallest)
    else:
        smallest, largest, residual = extreme_eigenvalues(
            apply, x, method=method, iterations=iterations, project=project, seed=seed
        )
        root = chart.rate_root(x)

        def scaled(w: Tensor) -> Tensor:  # -(1/tau) R Hess R: the spectrum of J (Lambda^(1/2) Hess_R Lambda^(1/2))
            return -root(apply(root(project(w)))) / field.tau

        low, high, _ = extreme_eigenvalues(scaled, x, method=method, iterations=iterations, project=project, seed=seed + 1)
        rate_slowest, rate_fastest = high, low
    tol = _zero_tol(smallest, largest, rel_tol, abs_tol)
    samples = _samples(
        (smallest, largest, residual), eigenvalues, tol, (rate_slowest, rate_fastest), (rms_tangent_gradient, critical_tol)
    )
    return StabilityReport(
        samples=samples,
        method=method,
        dimension=dimension,
        zero_tol=float(tol.max()),
        settings={"rel_tol": rel_tol, "abs_tol": abs_tol, "iterations": iterations, "critical_tol": critical_tol},
        spheres=chart.name == "spheres",
    )


# -- reaching the fixed point -------------------------------------------------------------------------------------


@dataclass
class FixedPointSearch:
    """Result of :func:`find_fixed_point`, a summary of the :class:`~et_ode.Attractor` it holds.

    Attributes:
        x: the points ``(B, N, D)``, on the flow's limit spheres (or at a finite scale where the flow stops in
            ``x``).
        rms_tangent_gradient: the certificate's RMS residual per sample at the end ``(B,)`` (RMS ``|T dE/dg|`` on
            the spheres).
        iterations: the most iterations a sample used.
        converged: every sample converged.
        energy_start: the energy at the start ``(B,)``.
        energy_end: the energy at the end ``(B,)``.
        attractor: the :class:`~et_ode.Attractor` found.
    """

    x: Tensor
    rms_tangent_gradient: Tensor
    iterations: int
    converged: bool
    energy_start: Tensor
    energy_end: Tensor
    attractor: Attractor


def find_fixed_point(field: ETField, x: Tensor, *, tol: float = 1e-6, max_iter: int = 5000) -> FixedPointSearch:
    """Descend from ``x`` (``(B, N, D)`` or ``(N, D)``) to a nearby critical point of ``E``: a view of
    ``find_attractor(field, x, flow=False, method="gradient", tol=tol, max_iter=max_iter)``.

    Riemannian gradient descent from ``x`` itself (not along the flow), on the flow's limit spheres of radius
    ``gamma sqrt(D)`` (in ``x`` where a token's outward force is not positive), with the same placement, critical
    points, energies and eigenvalues as :func:`et_ode.find_attractor`; its per-sample status, geometry and spectrum
    are in ``attractor``. For the attractor of the flow that starts at ``x``, use :func:`et_ode.find_attractor`.

    Args:
        field: the vector field.
        x: start states ``(B, N, D)`` or ``(N, D)``.
        tol: the RMS gradient at which a sample counts as converged.
        max_iter: descent iterations at most.

    Returns:
        A :class:`FixedPointSearch`; its ``x`` is ``(B, N, D)``.

    Raises:
        ValueError: a non-positive ``gamma``, ``tol`` or ``max_iter``.
    """
    x = batched_states(x, field)
    with torch.no_grad():
        energy_start = field.energy(x)
    found = find_attractor(field, x, flow=False, method="gradient", tol=tol, max_iter=max_iter)
    return FixedPointSearch(
        x=found.x,
        rms_tangent_gradient=found.gradient,
        iterations=int(found.iterations.max()),
        converged=bool(found.converged.all()),
        energy_start=energy_start,
        energy_end=found.energy,
        attractor=found,
    )
