"""Stability of fixed points: the Riemannian Hessian's spectrum, the Jacobian of the g-dynamics,
finite-time Lyapunov exponents and a basin probe.

Near a critical point ``g*`` the tangent dynamics of ``g`` is ``d(dg)/dt = J dg``, ``J = -(1/tau) Lambda Hess_R``,
which has the inertia of ``-Hess_R``: the point is classified from the Riemannian Hessian on the tangent space (the
two zero modes of every token left out) as a stable attractor, a saddle, a maximum or degenerate; the analysis guide
gives the derivation. Small systems get exact dense matrices by ``torch.func`` (``riemannian_hessian_matrix``,
``g_jacobian``), large ones the extreme eigenvalues by Lanczos or power iteration on Hessian-vector products;
``operator_stability`` takes any symmetric operator ``w -> A w``. ``find_fixed_point`` descends on the spheres
(:func:`et_ode.find_attractor`), and the flows of ``lyapunov_exponent`` and ``basin_probe`` undo the plain flow's
slowing time change between segments (``restart``: :class:`~et_ode.analysis.sphere.FixedScaleField`, or
:func:`~et_ode.dynamics.manifold.shrink_scale`, which keeps the path of ``g``). Points are placed on the flow's limit
spheres of radius ``gamma sqrt(D)`` (:func:`~et_ode.dynamics.manifold.to_limit_spheres`).

Shapes: states ``x`` are ``(B, N, D)`` (a single ``(N, D)`` is treated as ``B = 1``); vectors acted on
by operators have the shape of the state; dot products are per sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from et_ode import Adaptive, Attractor, ETField, find_attractor, solve
from et_ode.analysis.convergence import sample_field
from et_ode.analysis.lyapunov import ANALYSIS_MAX_STEPS, bounded_odeint
from et_ode.analysis.sphere import FixedScaleField, tangent_basis
from et_ode.dynamics.manifold import (
    radial_direction,
    retract,
    riemannian_hessian,
    shrink_scale,
    tangent_projection,
    to_limit_spheres,
)
from et_ode.linalg.krylov import lanczos

Operator = Callable[[Tensor], Tensor]
CLASSES = ("stable attractor", "saddle", "maximum", "degenerate")


def _batched(x: Tensor, field: ETField | None = None, name: str = "x") -> Tensor:
    """Validate a state and return it as ``(B, N, D)``."""
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


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample inner product: ``(B, ...) x (B, ...) -> (B,)``."""
    return (a * b).flatten(1).sum(dim=1)


def _expand(v: Tensor, like: Tensor) -> Tensor:
    return v.reshape(-1, *([1] * (like.dim() - 1)))


# -- generic symmetric eigen-solvers ------------------------------------------------------------------------------


def power_iteration(
    apply: Operator, v0: Tensor, *, iterations: int, shift: Tensor | float = 0.0, project: Operator | None = None
) -> Tensor:
    """The eigenvalue of largest magnitude of ``A - shift I`` per sample, by power iteration (Rayleigh quotient).

    ``shift`` is a scalar or ``(B,)``. Returns ``(B,)``, the estimate for ``A - shift I``.
    """
    project = project or (lambda v: v)
    shift = torch.as_tensor(shift, dtype=v0.dtype, device=v0.device).expand(v0.shape[0])
    v = project(v0)
    v = v / _expand(_dot(v, v).sqrt(), v)
    value = torch.zeros_like(shift)
    for _ in range(iterations):
        w = project(apply(v) - _expand(shift, v) * v)
        value = _dot(w, v)
        v = w / _expand(_dot(w, w).sqrt().clamp_min(torch.finfo(v.dtype).tiny), w)
    return value


def extreme_eigenvalues(
    apply: Operator,
    like: Tensor,
    *,
    method: str = "lanczos",
    iterations: int = 60,
    project: Operator | None = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Smallest and largest eigenvalue per sample of a symmetric operator, matrix-free.

    Args:
        apply: ``w -> A w`` on vectors shaped like ``like`` (``(B, ...)``).
        like: a tensor giving shape, dtype and device.
        method: ``"lanczos"`` (``iterations`` Krylov vectors) or ``"power"`` (``iterations`` products for
            the dominant eigenvalue, then as many for the other end of the spectrum on ``A - lambda_dom I``).
        project: projector onto the subspace where ``A`` is considered (e.g. the tangent space).
        seed: seeds the random starting vector.

    Returns ``(smallest, largest, residual)``, each ``(B,)``; ``residual`` is the larger of the two
    Lanczos residual bounds (``nan`` for power iteration).
    """
    generator = torch.Generator().manual_seed(seed)
    v0 = torch.randn(like.shape, generator=generator, dtype=like.dtype).to(like.device)
    if method == "lanczos":
        size = like[0].numel()
        values, residuals = lanczos(apply, v0, iterations=min(iterations, size), project=project, generator=generator)
        return values[:, 0], values[:, -1], torch.maximum(residuals[:, 0], residuals[:, -1])
    if method == "power":
        dominant = power_iteration(apply, v0, iterations=iterations, project=project)
        other = power_iteration(apply, v0, iterations=iterations, shift=dominant, project=project) + dominant
        nan = torch.full_like(dominant, math.nan)
        return torch.minimum(dominant, other), torch.maximum(dominant, other), nan
    raise ValueError(f"method must be 'lanczos' or 'power', got {method!r}")


def operator_matrix(apply: Operator, basis: Tensor) -> Tensor:
    """The matrix ``Q^T A Q`` per sample for an orthonormal ``basis`` ``(B, n, ...)`` (``n`` vectors per sample)."""
    columns = [apply(basis[:, j]) for j in range(basis.shape[1])]
    image = torch.stack(columns, dim=1).flatten(2)  # (B, n, size): row j = A q_j
    return basis.flatten(2) @ image.transpose(1, 2)


def dense_eigenvalues(apply: Operator, like: Tensor, *, basis: Tensor | None = None) -> Tensor:
    """All eigenvalues (ascending, ``(B, n)``) of a symmetric operator restricted to ``span(basis)``;
    the standard basis of the shape of ``like[0]`` when ``basis`` is None. Costs ``n`` products."""
    if basis is None:
        size = like[0].numel()
        eye = torch.eye(size, dtype=like.dtype, device=like.device).reshape(size, *like.shape[1:])
        basis = eye.expand(like.shape[0], *eye.shape)
    matrix = operator_matrix(apply, basis)
    return torch.linalg.eigvalsh((matrix + matrix.transpose(1, 2)) / 2)


def classify(smallest: float, largest: float, *, zero_tol: float) -> str:
    """One of :data:`CLASSES` from the extreme eigenvalues of a Hessian on the space of interest."""
    if smallest > zero_tol:
        return "stable attractor"
    if smallest < -zero_tol:
        return "maximum" if largest < -zero_tol else "saddle"
    return "degenerate"


# -- the ET's tangent space ---------------------------------------------------------------------------------------


def _rates(field: ETField, x: Tensor) -> Tensor:
    """``gamma / sigma_A`` per token, ``(B, N, 1)``: the tangential eigenvalue of ``M``."""
    neuron = field.model.neuron
    sigma = (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1, keepdim=True).add(neuron.eps).sqrt()
    return neuron.gamma.detach() / sigma


def riemannian_hessian_matrix(field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
    """The dense Riemannian Hessian of ``E`` at ``g = LayerNorm(x)`` in :func:`tangent_basis`, exact.

    Built from the full Euclidean Hessian of ``E(g)`` (``torch.func.hessian`` of the field's ``energy_g``,
    ``(ND)^2`` entries per sample): ``Q^T H Q - diag((s_A . dE/dg_A) / r_A)``. Returns
    ``(matrix (B, n, n), basis (B, n, N, D))``.
    """
    x = _batched(x, field)
    delta = field.model.neuron.delta.detach()
    with torch.no_grad():
        g = field.model.neuron(x)
        dE_dg = field.dE_dg(g)
    s, radius = radial_direction(g, delta)
    basis = tangent_basis(g, delta)
    d = x.shape[-1]
    matrices = []
    for b in range(x.shape[0]):
        hessian = torch.func.hessian(sample_field(field, b).energy_g)(g[b].detach())
        size = g[b].numel()
        q = basis[b].reshape(-1, size)
        curvature = ((dE_dg[b] * s[b]).sum(dim=-1) / radius[b, :, 0]).repeat_interleave(d - 2)
        matrices.append(q @ hessian.detach().reshape(size, size) @ q.T - torch.diag(curvature))
    return torch.stack(matrices), basis


def g_jacobian(field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
    """The exact Jacobian of the g-dynamics on the tangent space at ``x``, ``(B, n, n)``, and the basis.

    ``torch.func.jacrev`` of ``x -> dg/dt = M(x) f(x)`` (the field's ``dg_dt`` on its ``backend="reference"``
    closed form, which ``torch.func`` can trace); a tangent change ``dg`` of ``g`` is produced by
    ``dx = (sigma_A / gamma) dg``, so ``J = Q^T (d(dg/dt)/dx) Q diag(sigma_A / gamma)``. Its eigenvalues are
    the local rates ``exp(lambda t)`` of the motion of ``g`` at this state (``Re lambda < 0``: decay).
    """
    x = _batched(x, field)
    with torch.no_grad():
        g = field.model.neuron(x)
    basis = tangent_basis(g, field.model.neuron.delta.detach())
    scale = (1.0 / _rates(field, x)).detach()  # (B, N, 1): sigma / gamma
    d = x.shape[-1]
    matrices = []
    for b in range(x.shape[0]):
        closed_form = ETField(field.model, field.tau, mask=sample_field(field, b).mask, backend="reference")

        def dg_dt(xb: Tensor, closed_form: ETField = closed_form) -> Tensor:
            return closed_form.dg_dt(xb, closed_form.velocity(xb))

        jac = torch.func.jacrev(dg_dt)(x[b])
        size = x[b].numel()
        q = basis[b].reshape(-1, size)
        right = scale[b, :, 0].repeat_interleave(d - 2)
        matrices.append(q @ jac.detach().reshape(size, size) @ q.T * right[None, :])
    return torch.stack(matrices), basis


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class SampleStability:
    """The spectrum at one sample's point.

    ``smallest`` / ``largest``: extreme eigenvalues of ``Hess_R`` (intrinsic curvature, units of energy per
    ``g``^2). ``rate_slowest`` / ``rate_fastest``: extreme eigenvalues of the g-Jacobian at this state (per
    unit time; negative decays); ``eigenvalues``: all of ``Hess_R``'s when computed densely.
    ``rms_tangent_gradient``: RMS ``|T dE/dg|``; ``critical`` when it is at most ``critical_tol``.
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
class StabilityReport:
    samples: list[SampleStability]
    method: str
    dimension: int
    zero_tol: float
    settings: dict = field(default_factory=dict)

    def table(self) -> str:
        lines = [
            f"Riemannian Hessian on the tangent space (dimension {self.dimension} per sample, the all-ones and "
            f"radial zero modes of every token excluded), method: {self.method}; |lambda| <= {self.zero_tol:.2g} "
            "counts as zero.",
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

    def __str__(self) -> str:
        return self.table()

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "dimension": self.dimension,
            "zero_tol": self.zero_tol,
            "settings": self.settings,
            "samples": [asdict(s) for s in self.samples],
        }


def _zero_tol(smallest: Tensor, largest: Tensor, rel_tol: float, abs_tol: float) -> Tensor:
    return rel_tol * torch.maximum(smallest.abs(), largest.abs()) + abs_tol


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
    samples = []
    for b in range(like.shape[0]):
        samples.append(
            SampleStability(
                sample=b,
                kind=classify(float(smallest[b]), float(largest[b]), zero_tol=float(tol[b])),
                smallest=float(smallest[b]),
                largest=float(largest[b]),
                negative=None if eigenvalues is None else int((eigenvalues[b] < -tol[b]).sum()),
                rate_slowest=float(-smallest[b]),
                rate_fastest=float(-largest[b]),
                rms_tangent_gradient=math.nan,
                critical=True,
                residual=float(residual[b]),
                eigenvalues=None if eigenvalues is None else eigenvalues[b].tolist(),
            )
        )
    return StabilityReport(
        samples=samples,
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

    ``method``: ``"dense"`` (exact: ``torch.func`` Hessian of ``E``, and the Jacobian of the g-dynamics
    for the rates), ``"lanczos"`` / ``"power"`` (extreme eigenvalues from Hessian-vector products of
    :func:`et_ode.dynamics.manifold.riemannian_hessian`), ``"auto"`` (dense up to ``max_dense`` tangent dimensions).
    ``critical`` is reported per sample: RMS ``|T dE/dg| <= critical_tol``; away from a critical point the
    classification describes the local curvature only.
    """
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    x = _batched(x, field)
    batch, n, d = x.shape
    dimension = n * (d - 2)
    method = ("dense" if dimension <= max_dense else "lanczos") if method == "auto" else method
    if method not in ("dense", "lanczos", "power"):
        raise ValueError(f"method must be 'auto', 'dense', 'lanczos' or 'power', got {method!r}")
    g = field.model.neuron(x).detach()
    apply, tangent_gradient = riemannian_hessian(field, g)
    rms_tangent_gradient = tangent_gradient.square().mean(dim=(-1, -2)).sqrt()
    rates = _rates(field, x)
    s, _ = radial_direction(g, field.model.neuron.delta.detach())

    def project(w: Tensor) -> Tensor:
        return tangent_projection(w, s)

    eigenvalues = None
    if method == "dense":
        matrix, _ = riemannian_hessian_matrix(field, x)
        eigenvalues = torch.linalg.eigvalsh((matrix + matrix.transpose(1, 2)) / 2)
        smallest, largest = eigenvalues[:, 0], eigenvalues[:, -1]
        jacobian, _ = g_jacobian(field, x)
        rate_values = torch.linalg.eigvals(jacobian).real
        rate_slowest, rate_fastest = rate_values.max(dim=1).values, rate_values.min(dim=1).values
        residual = torch.zeros_like(smallest)
    else:
        smallest, largest, residual = extreme_eigenvalues(
            apply, g, method=method, iterations=iterations, project=project, seed=seed
        )
        root = rates.sqrt()

        def scaled(w: Tensor) -> Tensor:  # -(1/tau) Lambda^(1/2) Hess_R Lambda^(1/2), same spectrum as J
            return -root * apply(root * project(w)) / field.tau

        low, high, _ = extreme_eigenvalues(scaled, g, method=method, iterations=iterations, project=project, seed=seed + 1)
        rate_slowest, rate_fastest = high, low
    tol = _zero_tol(smallest, largest, rel_tol, abs_tol)
    samples = []
    for b in range(batch):
        samples.append(
            SampleStability(
                sample=b,
                kind=classify(float(smallest[b]), float(largest[b]), zero_tol=float(tol[b])),
                smallest=float(smallest[b]),
                largest=float(largest[b]),
                negative=None if eigenvalues is None else int((eigenvalues[b] < -tol[b]).sum()),
                rate_slowest=float(rate_slowest[b]),
                rate_fastest=float(rate_fastest[b]),
                rms_tangent_gradient=float(rms_tangent_gradient[b]),
                critical=bool(rms_tangent_gradient[b] <= critical_tol),
                residual=float(residual[b]),
                eigenvalues=None if eigenvalues is None else eigenvalues[b].tolist(),
            )
        )
    return StabilityReport(
        samples=samples,
        method=method,
        dimension=dimension,
        zero_tol=float(tol.max()),
        settings={"rel_tol": rel_tol, "abs_tol": abs_tol, "iterations": iterations, "critical_tol": critical_tol},
    )


# -- reaching the fixed point -------------------------------------------------------------------------------------


@dataclass
class FixedPointSearch:
    """Result of :func:`find_fixed_point`, a summary of the :class:`~et_ode.Attractor` it holds: ``x`` ``(B, N, D)``
    (on the flow's limit spheres, or at a finite scale where the flow stops in ``x``); the certificate's RMS
    residual per sample at the end (RMS ``|T dE/dg|`` on the spheres); the most iterations a sample used; whether
    every sample converged; the energy at the start and at the end per sample."""

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
    Raises ValueError for a non-positive ``gamma``, ``tol`` or ``max_iter``.
    """
    x = _batched(x, field)
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


def flow(
    field: ETField,
    x: Tensor,
    duration: float,
    *,
    segments: int = 1,
    restart: bool = True,
    method: str = "dopri5",
    rtol: float = 1e-7,
    atol: float = 1e-9,
) -> Tensor:
    """Integrate the ET dynamics for ``segments`` consecutive spans of ``duration / segments``; with
    ``restart`` each span starts from ``shrink_scale(x)`` (each sample shrunk by one factor to token scales of at
    most 1: the same path of ``g``, undone slow-down). Returns the final ``x``."""
    for _ in range(segments):
        if restart:
            x = shrink_scale(x)
        x = solve(field, x, (0.0, duration / segments), solver=Adaptive(method, rtol, atol), save="final").x.detach()
    return x


@dataclass
class LyapunovExponent:
    """Finite-time largest Lyapunov exponent per sample, ``(B,)``, and its running estimate ``(K, B)``
    at the renormalisation times ``times`` ``(K,)`` (measured in ``g``, per unit of time of the flow).

    ``late``: the growth rate over the second half of the renormalisations only, ``(B,)``: the start's
    transient (the random perturbation's components along faster modes) is discarded, so it approaches the
    asymptotic exponent like ``exp(-gap T / 2)`` instead of ``1 / T``."""

    exponent: Tensor
    times: Tensor
    running: Tensor
    d0: float
    late: Tensor


def lyapunov_exponent(
    field: ETField,
    x0: Tensor,
    *,
    duration: float = 10.0,
    renormalizations: int = 20,
    d0: float = 1e-6,
    restart: bool = False,
    method: str = "dopri5",
    rtol: float = 1e-9,
    atol: float = 1e-11,
    seed: int = 0,
    progress: bool = False,
    max_steps: int = ANALYSIS_MAX_STEPS,
) -> LyapunovExponent:
    """Benettin's method: the growth rate of a small tangent perturbation of ``g`` (size ``d0``).

    The pair (reference, perturbed) is integrated together for ``duration`` in ``renormalizations`` spans;
    after each, the g-distance ``d`` is measured, ``log(d / d0)`` accumulated and the perturbation of ``x``
    rescaled to ``d0``. Negative: nearby trajectories converge.

    With ``restart`` the exponent is measured in intrinsic time: both states start on the limit spheres and
    follow the :class:`~et_ode.analysis.sphere.FixedScaleField`, which keeps ``sigma`` fixed and the tangential
    rates at ``gamma / tau`` throughout (the limit of rescaling continuously). At a minimum it converges to
    ``-(gamma / tau) lambda_min(Hess_R)``. Rescaling only at the start of each span would be biased toward zero:
    within a span ``sigma`` grows like ``1 + kappa gamma t / tau`` (``kappa = rho / r``, the outward force over
    the radius), which slows the decay to ``-(lambda / kappa) ln(1 + kappa gamma Delta) / Delta``. Without
    ``restart`` the exponent is that of the plain flow, whose rates decay like ``1 / t``: a finite-time exponent
    of the transient.

    Each span's integration has a budget of ``max_steps`` steps (:class:`et_ode.SolveError` beyond it).
    """
    from tqdm.auto import tqdm

    x = _batched(x0, field)
    if not (duration > 0 and d0 > 0):
        raise ValueError(f"duration and d0 must be positive, got duration={duration}, d0={d0}")
    model = field.model
    if restart:
        x = to_limit_spheres(x, model.neuron.eps)
    generator = torch.Generator().manual_seed(seed)
    g = model.neuron(x).detach()
    s, _ = radial_direction(g, model.neuron.delta.detach())
    w = tangent_projection(torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device), s)
    w = w * d0 / _expand(_dot(w, w).sqrt(), w)
    pair = torch.cat([x, x + w / _rates(field, x)])
    fixed_scale = FixedScaleField(field)
    span = duration / renormalizations
    logs, times = [], []
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    batch = x.shape[0]
    for k in tqdm(range(renormalizations), desc="Lyapunov exponent", disable=not progress, leave=False):
        if restart:
            pair = to_limit_spheres(pair, model.neuron.eps)
            grid = torch.tensor([0.0, span], dtype=pair.dtype, device=pair.device)
            with torch.no_grad():
                pair = bounded_odeint(
                    fixed_scale,
                    pair,
                    grid,
                    method=method,
                    rtol=rtol,
                    atol=atol,
                    max_steps=max_steps,
                    what="lyapunov_exponent (restart)",
                )[-1]
        else:
            pair = solve(
                field, pair, (0.0, span), solver=Adaptive(method, rtol, atol), save="final", max_steps=max_steps
            ).x.detach()
        with torch.no_grad():
            gs = model.neuron(pair)
        dist = _dot(gs[batch:] - gs[:batch], gs[batch:] - gs[:batch]).sqrt()
        total += (dist / d0).log().to(torch.float64).cpu()
        logs.append(total / ((k + 1) * span))
        times.append((k + 1) * span)
        scale = _expand(d0 / dist.clamp_min(torch.finfo(dist.dtype).tiny), pair[:batch])
        pair = torch.cat([pair[:batch], pair[:batch] + (pair[batch:] - pair[:batch]) * scale])
    running = torch.stack(logs)
    times_tensor = torch.tensor(times, dtype=torch.float64)
    half = renormalizations // 2 - 1
    before = running[half] * times_tensor[half] if half >= 0 else torch.zeros_like(total)
    late = (total - before) / (duration - (times_tensor[half] if half >= 0 else 0.0))
    return LyapunovExponent(exponent=total / duration, times=times_tensor, running=running, d0=d0, late=late)


@dataclass
class BasinProbe:
    """``returned[b, j]``: fraction of the trials at radius ``radii[j]`` that came back (final g-distance to the
    fixed point at most ``shrink`` times the initial one); ``radius[b]``: the largest radius up to which every
    trial came back (0 if none). Radii are RMS per element of the g-perturbation divided by ``gamma``."""

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
    duration: float = 20.0,
    segments: int = 10,
    shrink: float = 0.5,
    seed: int = 0,
    rtol: float = 1e-7,
    atol: float = 1e-9,
    progress: bool = False,
) -> BasinProbe:
    """Perturb the fixed point(s) ``x_star`` (``(B, N, D)``) with random tangent noise of growing size and
    follow the dynamics (with scale restarts, see :func:`flow`) for ``duration``.

    ``radii`` default: ``0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1``.
    """
    from tqdm.auto import tqdm

    x = to_limit_spheres(_batched(x_star, field, "x_star"), field.model.neuron.eps)
    radii = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0] if radii is None else [float(r) for r in radii]
    if not radii or any(not r > 0 for r in radii) or sorted(radii) != radii:
        raise ValueError(f"radii must be positive and increasing, got {radii}")
    model = field.model
    gamma = float(model.neuron.gamma.detach())
    generator = torch.Generator().manual_seed(seed)
    batch, n, d = x.shape
    g_star = model.neuron(x).detach()
    s, _ = radial_direction(g_star, model.neuron.delta.detach())
    starts = x.repeat(trials, 1, 1)  # (trials * B, N, D), trial-major
    s_all = s.repeat(trials, 1, 1)
    target = g_star.repeat(trials, 1, 1)
    returned = torch.zeros(batch, len(radii), dtype=torch.float64)
    final = torch.zeros(batch, len(radii), trials, dtype=torch.float64)
    for j, radius in enumerate(tqdm(radii, desc="basin probe", disable=not progress, leave=False)):
        w = tangent_projection(torch.randn(starts.shape, generator=generator, dtype=x.dtype).to(x.device), s_all)
        w = w * radius * gamma / w.square().mean(dim=(-1, -2), keepdim=True).sqrt()
        perturbed = retract(starts, w, gamma, model.neuron.eps)
        with torch.no_grad():
            initial = (model.neuron(perturbed) - target).square().mean(dim=(-1, -2)).sqrt()
        end = flow(field, perturbed, duration, segments=segments, rtol=rtol, atol=atol)
        with torch.no_grad():
            distance = (model.neuron(end) - target).square().mean(dim=(-1, -2)).sqrt()
        back = (distance <= shrink * initial).reshape(trials, batch)
        returned[:, j] = back.to(torch.float64).mean(dim=0).cpu()
        final[:, j] = (distance / gamma).reshape(trials, batch).T.to(torch.float64).cpu()
    radius_per_sample = []
    for b in range(batch):
        full = (returned[b] == 1.0).tolist()
        count = full.index(False) if False in full else len(full)
        radius_per_sample.append(radii[count - 1] if count else 0.0)
    return BasinProbe(radii=radii, returned=returned, final_distance=final, radius=radius_per_sample, shrink=shrink)
