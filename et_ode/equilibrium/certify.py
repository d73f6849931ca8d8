"""Where a flow ends, and how sure we are: the hand-off loop, Newton, the certificate and the basin test behind
:func:`et_ode.find_attractor` (the method is described there, in :mod:`et_ode.equilibrium.attractor`) and behind the implicit
gradient of :func:`et_ode.solve` (:class:`et_ode.Implicit`, which polishes a solve's end state here). The flow phase
runs on the integration loop directly, below ``solve``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor
from torchdiffeq import odeint

from et_ode.dynamics.field import ETField
from et_ode.dynamics.manifold import (
    euclidean_hessian,
    radial_direction,
    retract,
    riemannian_hessian,
    shrink_scale,
    tangent_projection,
    to_limit_spheres,
)
from et_ode.energy.neurons import sphere_neuron
from et_ode.equilibrium.implicit import implicit_attractor
from et_ode.integrators.adaptive_loop import cuts_per_sample
from et_ode.integrators.loop import Problem, integrate
from et_ode.integrators.solution import SolveError
from et_ode.integrators.solvers import BUDGET_ADVICE, Adaptive, SolverFailure
from et_ode.integrators.stopping import SteadyState
from et_ode.linalg.krylov import lanczos, sample_dot

#: find_attractor's method: Newton with a descent fallback, or descent only
SearchMethod = Literal["newton", "gradient"]
SEARCH_METHODS: tuple[SearchMethod, ...] = get_args(SearchMethod)
#: an attractor's per-sample kind, geometry and status (Attractor)
Kind = Literal["stable", "saddle", "degenerate"]
Geometry = Literal["spheres", "x", "mixed"]
AttractorStatus = Literal["certified", "unsettled", "not_converged", "saddle", "degenerate", "mixed"]
HANDOFF, HANDOFFS = 0.1, 6  # the first hand-off level (RMS |T dE/dg|), and how many levels at most (each 10x lower)
SEGMENT, MAX_SEGMENTS = 20.0, 50  # the flow phase: segments of SEGMENT * tau between rescalings, per level
FLOW_RTOL, FLOW_ATOL = 1e-4, 1e-8  # the flow phase's dopri5 tolerances
FLOW_MAX_STEPS = 2_000  # the flow phase's step budget per segment (a flow needing more is too stiff to follow)


@dataclass(frozen=True)
class FlowPhase:
    """How :func:`flow_to` integrates (validated by :func:`et_ode.find_attractor`): segments of ``segment * tau``
    between rescalings, at most ``max_segments`` per hand-off level, dopri5 at ``rtol`` / ``atol``."""

    segment: float = SEGMENT
    max_segments: int = MAX_SEGMENTS
    rtol: float = FLOW_RTOL
    atol: float = FLOW_ATOL


# the per-sample tensors of an Attractor besides g, shape (B, ...) in a flattened batch
_PER_SAMPLE = (
    "x",
    "energy",
    "gradient",
    "smallest_eigenvalue",
    "largest_eigenvalue",
    "converged",
    "outward_force",
    "settled",
    "iterations",
)


@dataclass(frozen=True)
class Attractor:
    """What :func:`et_ode.find_attractor` returns (per-sample entries have shape ``(*batch,)``).

    Attributes:
        x: the state ``(*batch, N, D)``, detached (on the spheres: at the scale described in the module docstring).
        g: ``neuron(x)`` (``LayerNorm(x)`` for the ET), ``(*batch, N, D)``; differentiable with respect to the
            model's parameters (implicit).
        energy: ``E`` per sample.
        gradient: the certificate's residual: RMS ``|T dE/dg|`` on the spheres, RMS of ``dE/dg`` without the
            directions every ``M`` annihilates (the neuron's ``project``) for ``geometry="x"``.
        smallest_eigenvalue: smallest eigenvalue of the Riemannian Hessian on the tangent space (spheres), or of
            the Hessian of ``E(g(x))`` in ``x`` (geometry ``"x"``, on centred ``x`` for LayerNorm), by Lanczos.
        largest_eigenvalue: the largest, from the same Lanczos run (sets the zero tolerance of ``kind``).
        kind: ``"stable"``, ``"saddle"`` or ``"degenerate"`` per sample (a tuple, flattened batch order).
        geometry: ``"spheres"`` or ``"x"`` per sample (always ``"x"`` for a neuron of Euclidean geometry).
        converged: the residual is below ``tol``, per sample.
        outward_force: the smallest ``rho_A = -s_A . dE/dg_A`` over the tokens, per sample (NaN for a neuron of
            Euclidean geometry, which has no spheres).
        settled: the flow from the examined start is in the point's basin by the linear-regime test
            (:func:`basin_settled`), per sample.
        status: per sample (a tuple, flattened batch order): ``"certified"`` (converged, stable and settled),
            ``"unsettled"`` (a converged stable point the test cannot tie to the flow's start), ``"not_converged"``,
            ``"saddle"``, ``"degenerate"``, or ``"mixed"`` (some tokens head for their spheres while others stop at
            a finite scale: neither geometry holds the point, so it is not certified).
        iterations: Newton (or gradient) iterations per sample.
        flow_evaluations: field evaluations of the flow phase (all samples together).
        evaluations: every field evaluation and Hessian-vector product, the flow's included.
        energy_evaluations: energies computed to accept or reject steps (not in ``evaluations``).
        tol: the tolerance certified against.
    """

    x: Tensor
    g: Tensor
    energy: Tensor
    gradient: Tensor
    smallest_eigenvalue: Tensor
    largest_eigenvalue: Tensor
    kind: tuple[Kind, ...]
    geometry: tuple[Geometry, ...]
    converged: Tensor
    outward_force: Tensor
    settled: Tensor
    status: tuple[AttractorStatus, ...]
    iterations: Tensor
    flow_evaluations: int
    evaluations: int
    energy_evaluations: int
    tol: float

    @property
    def certified(self) -> Tensor:
        """Status ``"certified"`` per sample ``(*batch,)``: the points whose gradient is defined."""
        certified = torch.tensor([s == "certified" for s in self.status], device=self.converged.device)
        return certified.reshape(self.converged.shape)


def default_tol(dtype: torch.dtype) -> float:
    """``1e-8`` in float64, ``1e-4`` in float32 (a few hundred rounding units of ``dE/dg``), ``10 eps`` below."""
    if dtype == torch.float64:
        return 1e-8
    return 1e-4 if dtype == torch.float32 else 10 * torch.finfo(dtype).eps


def _rms(v: Tensor) -> Tensor:
    """Per-sample RMS ``(B, N, D) -> (B,)``."""
    return sample_dot(v, v).sqrt() / math.sqrt(v[0].numel())


def _col(v: Tensor) -> Tensor:
    return v[:, None, None]


# -- the two geometries -------------------------------------------------------------------------------------------

Operator = Callable[[Tensor], Tensor]


class _Spheres:
    """Critical points of ``E`` on the product of spheres; tangent vectors in ``g`` coordinates."""

    name: ClassVar[Geometry] = "spheres"

    def __init__(self, field: ETField):
        self.field = field
        neuron = sphere_neuron(field.model.neuron, "find_attractor's sphere geometry")
        self.delta, self.eps = neuron.delta.detach(), neuron.eps
        self.gamma = float(neuron.gamma.detach())

    def canonical(self, x: Tensor) -> Tensor:
        """Every token on its limit sphere (:func:`et_ode.dynamics.manifold.to_limit_spheres`)."""
        return to_limit_spheres(x, self.eps)

    def gradient(self, field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(T dE/dg, residual)`` at ``x``: the convergence measure per sample is the RMS of ``T dE/dg``
        (scale-free)."""
        g = field.model.neuron(x)
        field.count_evaluations()
        s, _ = radial_direction(g, self.delta)
        tangent = tangent_projection(field.dE_dg(g), s)
        return tangent, _rms(tangent)

    def hessian(self, field: ETField, x: Tensor) -> tuple[Operator, Tensor, Operator, Tensor]:
        """``(Hess_R, T dE/dg, T, residual)`` at ``x``."""
        g = field.model.neuron(x).detach()
        field.count_evaluations()
        apply, tangent = riemannian_hessian(field, g)
        s, _ = radial_direction(g, self.delta)
        return apply, tangent, lambda w: tangent_projection(w, s), _rms(tangent)

    def displacement(self, found: Tensor, point: Tensor) -> Tensor:
        """From ``found`` to ``point`` along each token's great circle: the logarithm map in ``g`` (a tangent vector
        at ``found`` of length ``r theta_A``, ``theta_A`` the angle between the tokens; what :meth:`retract` takes)."""
        u, radius = radial_direction(self.field.model.neuron(found), self.delta)
        w, _ = radial_direction(self.field.model.neuron(point), self.delta)
        cosine = (u * w).sum(dim=-1, keepdim=True).clamp(-1.0, 1.0)
        along = w - cosine * u
        norm = along.norm(dim=-1, keepdim=True)
        theta = torch.atan2(norm, cosine)
        return along * (radius * theta / norm.clamp_min(torch.finfo(u.dtype).tiny))

    def size(self, x: Tensor) -> Tensor:
        """The length scale of a step per sample (the largest trust region): ``gamma sqrt(N D)``."""
        return torch.full(x.shape[:1], self.gamma * math.sqrt(x[0].numel()), dtype=x.dtype, device=x.device)

    def retract(self, x: Tensor, step: Tensor) -> Tensor:
        """Move ``g`` by the tangent ``step`` and back onto the limit spheres (:func:`~et_ode.dynamics.manifold.retract`)."""
        return retract(x, step, self.gamma, self.eps)


class _Euclidean:
    """Critical points of ``F(x) = E(g(x))`` over the ``x`` the neuron's ``project`` keeps (centred ``x`` for
    LayerNorm): fixed points of the flow in ``x``."""

    name: ClassVar[Geometry] = "x"

    def __init__(self, field: ETField):
        self.field = field
        self.neuron = field.model.neuron

    def canonical(self, x: Tensor) -> Tensor:
        """``x`` without the directions ``g`` does not depend on (the token means for LayerNorm)."""
        return self.neuron.project(x)

    def gradient(self, field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(dF/dx = M dE/dg, residual)`` at ``x``: the convergence measure per sample is the RMS of the projected
        ``dE/dg`` (centred for LayerNorm), zero exactly at a fixed point in ``x`` whatever the token scale
        (``M dE/dg`` alone shrinks like ``1 / sigma`` as LayerNorm's tokens grow)."""
        field.count_evaluations()
        grad_e = field.dE_dg(self.neuron(x))
        return self.neuron.hessian_vector(x, grad_e), _rms(self.neuron.project(grad_e))

    def hessian(self, field: ETField, x: Tensor) -> tuple[Operator, Tensor, Operator, Tensor]:
        """``(Hess F, dF/dx, projection, residual)`` at ``x`` (:func:`et_ode.dynamics.manifold.euclidean_hessian`)."""
        field.count_evaluations()
        apply, gradient, grad_e = euclidean_hessian(field, x)
        return apply, gradient, self.canonical, _rms(self.neuron.project(grad_e))

    def size(self, x: Tensor) -> Tensor:
        """The length scale of a step per sample (the largest trust region): the norm of the projected ``x``."""
        return self.canonical(x).flatten(1).norm(dim=1).clamp_min(torch.finfo(x.dtype).eps)

    @staticmethod
    def retract(x: Tensor, step: Tensor) -> Tensor:
        return x + step


# -- trust-region Newton with truncated conjugate gradients -------------------------------------------------------


def _to_boundary(p: Tensor, d: Tensor, radius: Tensor) -> Tensor:
    """The ``tau >= 0`` with ``|p + tau d| = radius`` per sample."""
    dd, pd, pp = sample_dot(d, d), sample_dot(p, d), sample_dot(p, p)
    disc = (pd.square() + dd * (radius.square() - pp)).clamp_min(0)
    return (-pd + disc.sqrt()) / dd.clamp_min(torch.finfo(p.dtype).tiny)


def _steihaug(
    apply: Callable[[Tensor], Tensor], grad: Tensor, radius: Tensor, *, forcing: Tensor, max_iter: int
) -> tuple[Tensor, Tensor]:
    """Approximately minimize ``m(p) = grad . p + p . H p / 2`` per sample within ``|p| <= radius``.

    Steihaug's truncated conjugate gradients: stop at the boundary, along a direction of non-positive
    curvature (to the boundary: the way down from a saddle), or once the residual is below ``forcing``.
    Returns the step and the predicted decrease ``-m(p)`` per sample.
    """
    p = torch.zeros_like(grad)
    hp = torch.zeros_like(grad)
    r = grad.clone()
    d = -r
    rr = sample_dot(r, r)
    done = rr.sqrt() <= forcing
    for _ in range(max_iter):
        if bool(done.all()):
            break
        hd = apply(d)
        curvature = sample_dot(d, hd)
        alpha = rr / torch.where(curvature > 0, curvature, torch.ones_like(curvature))
        p_next = p + _col(alpha) * d
        boundary = ~done & ((curvature <= 0) | (sample_dot(p_next, p_next).sqrt() >= radius))
        tau = _to_boundary(p, d, radius)
        step = torch.where(boundary, tau, torch.where(done, torch.zeros_like(alpha), alpha))
        p = p + _col(step) * d
        hp = hp + _col(step) * hd
        r = r + _col(step) * hd
        rr_next = sample_dot(r, r)
        done = done | boundary | (rr_next.sqrt() <= forcing)
        d = torch.where(_col(done), d, -r + _col(rr_next / rr.clamp_min(torch.finfo(rr.dtype).tiny)) * d)
        rr = rr_next
    predicted = -(sample_dot(grad, p) + 0.5 * sample_dot(p, hp))
    return p, predicted


def _energy(field: ETField, g: Tensor) -> Tensor:
    return field.model.energy_g(g, field.mask)


def _descend(
    geometry: _Spheres | _Euclidean,
    field: ETField,
    x: Tensor,
    *,
    tol: float,
    method: SearchMethod,
    max_iter: int,
    cg_max_iter: int,
    counters: dict[str, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """Trust-region Newton (or Riemannian gradient descent) per sample until its RMS gradient is below ``tol``.

    Newton: Steihaug's step, accepted when the ratio of actual to predicted decrease of ``E`` exceeds 1e-4; the
    radius doubles after a good step to the boundary (ratio > 0.75), shrinks to a quarter of a poor step's length
    (ratio < 0.25). Gradient descent: ``-step * grad`` with an Armijo test, the step grown by 1.5 or halved. Once
    the predicted decrease is below the rounding of ``E``, a step is accepted when it reduces the gradient. A
    sample whose trust radius collapses falls back to gradient descent; one whose step underflows stops there.
    Samples leave the batch when they finish. Returns the states, the RMS gradients and the iterations per sample.
    """
    batch = x.shape[0]
    rounding, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
    x = geometry.canonical(x)
    scale = geometry.size(x)
    iterations = torch.zeros(batch, dtype=torch.long)
    rms = torch.full((batch,), math.inf, dtype=x.dtype)
    radius = 0.1 * scale
    step = torch.full((batch,), 0.1, dtype=x.dtype)
    fallback = torch.full((batch,), method == "gradient")
    with torch.no_grad():
        energy = _energy(field, field.model.neuron(x))
    counters["energy"] += 1
    active = torch.arange(batch)
    while len(active):
        bound = field.select(active)
        xa = x[active]
        newton = ~fallback[active]
        if bool(newton.any()):
            apply, grad, _, residual = geometry.hessian(bound, xa)
        else:
            with torch.no_grad():
                grad, residual = geometry.gradient(bound, xa)
        norm = sample_dot(grad, grad).sqrt()
        rms[active] = residual.detach()
        done = (rms[active] < tol) | (iterations[active] >= max_iter)
        if bool(done.all()):
            break
        trial_step = -_col(step[active]) * grad
        predicted = step[active] * norm.square()
        if bool(newton.any()):  # finished samples ride along this once, frozen (an infinite forcing term)
            forcing = torch.where(done | ~newton, torch.full_like(norm, math.inf), norm * norm.clamp(max=0.1))
            p, newton_predicted = _steihaug(apply, grad, radius[active], forcing=forcing, max_iter=cg_max_iter)
            trial_step = torch.where(_col(newton), p, trial_step)
            predicted = torch.where(newton, newton_predicted, predicted)
        with torch.no_grad():
            trial = geometry.retract(xa, trial_step)
            trial_energy = _energy(bound, bound.model.neuron(trial))
            counters["energy"] += 1
            actual = energy[active] - trial_energy
            below = predicted <= 100 * rounding * energy[active].abs().clamp_min(1.0)
            trial_norm = torch.full_like(norm, math.inf)
            if bool((below & ~done).any()):
                trial_grad, _ = geometry.gradient(bound, trial)
                trial_norm = sample_dot(trial_grad, trial_grad).sqrt()
        ratio = actual / predicted.clamp_min(tiny)
        accept = torch.where(below, trial_norm < norm, torch.where(newton, ratio > 1e-4, actual >= 1e-4 * predicted))
        accept = accept & ~done
        x[active] = torch.where(_col(accept), trial, xa)
        energy[active] = torch.where(accept, trial_energy, energy[active])
        length, r = sample_dot(trial_step, trial_step).sqrt(), radius[active]
        good = accept & ~below & (ratio > 0.75) & (length >= 0.99 * r)
        poor = ~accept | (~below & (ratio < 0.25))
        radius[active] = torch.where(good, torch.minimum(2 * r, scale[active]), torch.where(poor & newton, 0.25 * length, r))
        step[active] = torch.where(accept, step[active] * 1.5, step[active] * 0.5)
        fallback[active] = fallback[active] | (radius[active] < 1e-12 * scale[active])
        stuck = fallback[active] & (step[active] < 1e-16)
        iterations[active] += (~done).long()
        active = active[~(done | stuck)]
    return x, rms, iterations


# -- certificate ----------------------------------------------------------------------------------------------------


def _classify(smallest: float, largest: float, zero_tol: float) -> Kind:
    if smallest > zero_tol:
        return "stable"
    return "saddle" if smallest < -zero_tol else "degenerate"


def token_forces(field: ETField, x: Tensor) -> Tensor:
    """The outward force ``rho_A = -s_A . dE/dg_A`` of every token, ``(B, N, D) -> (B, N)`` (one evaluation; the
    LayerNorm neuron's spheres)."""
    neuron = sphere_neuron(field.model.neuron, "the outward force")
    g = neuron(x)
    s, _ = radial_direction(g, neuron.delta.detach())
    field.count_evaluations()
    return -(s * field.dE_dg(g)).sum(dim=-1)


def flatten(field: ETField, x: Tensor) -> tuple[Tensor, ETField]:
    """``x`` ``(*batch, N, D)`` as ``(B, N, D)`` (detached, a copy) and ``field`` bound to its mask expanded to match
    (``(B, N, N)`` for a per-sample mask)."""
    batch_shape, (n, d) = x.shape[:-2], x.shape[-2:]
    mask = field.mask
    if isinstance(mask, Tensor) and mask.dim() > 2:
        mask = mask.expand(*batch_shape, n, n).reshape(-1, n, n)
    return x.detach().reshape(-1, n, d).clone(), field.with_mask(mask)


@dataclass
class _Search:
    """Per-sample results of the Newton phase over a flattened batch ``(B, N, D)``."""

    x: Tensor
    gradient: Tensor
    iterations: Tensor
    geometry: list[Geometry]


def _descend_where(
    geometry: _Spheres | _Euclidean,
    field: ETField,
    search: _Search,
    selected: Tensor,
    starts: Tensor,
    options: dict[str, Any],
    counters: dict[str, int],
) -> None:
    """Run :func:`_descend` in ``geometry`` on the samples ``selected`` ``(B,)`` from ``starts`` ``(B, N, D)``,
    writing their results into ``search``."""
    index = torch.nonzero(selected).flatten()
    if not len(index):
        return
    found, rms, its = _descend(geometry, field.select(index), starts[index], counters=counters, **options)
    search.x[index], search.gradient[index] = found, rms
    search.iterations[index] += its
    for i in index.tolist():
        search.geometry[i] = geometry.name


def _search(field: ETField, x: Tensor, options: dict[str, Any], counters: dict[str, int]) -> _Search:
    """Newton from ``x`` ``(B, N, D)`` in the geometry the outward forces choose.

    A sample whose tokens all have ``rho > 0`` descends on the spheres; if the point found there has a token with
    ``rho <= 0`` (that token would leave its sphere), or the start has one, it descends in ``x`` from the start. A
    search in ``x`` that does not converge while every token pushes outward is heading for the spheres and goes
    on there. A sample that settles in neither geometry is ``"mixed"``. A neuron of Euclidean geometry descends in
    ``x`` alone.
    """
    euclidean = _Euclidean(field)
    search = _Search(
        x.clone(),
        torch.full(x.shape[:1], math.inf, dtype=x.dtype),
        torch.zeros(x.shape[0], dtype=torch.long),
        ["spheres"] * x.shape[0],
    )
    if field.model.neuron.geometry != "spheres":
        _descend_where(euclidean, field, search, torch.ones(x.shape[0], dtype=torch.bool), x, options, counters)
        return search
    spheres = _Spheres(field)
    with torch.no_grad():
        outward = (token_forces(field, x) > 0).all(dim=-1)
    _descend_where(spheres, field, search, outward, x, options, counters)
    with torch.no_grad():
        on_spheres = outward & (token_forces(field, search.x) > 0).all(dim=-1)
    sphere_x = search.x.clone()
    _descend_where(euclidean, field, search, ~on_spheres, x, options, counters)
    with torch.no_grad():
        escaping = ~outward & (search.gradient >= options["tol"]) & (token_forces(field, search.x) > 0).all(dim=-1)
    _descend_where(spheres, field, search, escaping, search.x, options, counters)
    with torch.no_grad():
        forces_ok = (token_forces(field, search.x) > 0).all(dim=-1)
    failed_x = ~on_spheres & ~escaping & (search.gradient >= options["tol"])
    mixed = (escaping & ~forces_ok) | (outward & failed_x)
    for i in torch.nonzero(mixed).flatten().tolist():
        search.geometry[i] = "mixed"
    mixed_from_spheres = outward & failed_x  # report the point the spheres gave, with its inward token
    search.x[mixed_from_spheres] = sphere_x[mixed_from_spheres]
    return search


def basin_settled(
    field: ETField, start: Tensor, found: Tensor, smallest: Tensor, geometry: list[Geometry], *, tol: float
) -> Tensor:
    """Whether the flow from ``start`` ends at ``found`` (both ``(B, N, D)``), by the linear-regime test, ``(B,)``.

    Near a minimum with Hessian ``H`` (smallest eigenvalue ``lambda > 0``, given as ``smallest``) the gradient is
    ``H v`` for the displacement ``v`` from the minimum, up to a Taylor error. Where that error is below ``c lambda |v|``
    with ``c < 1``, the flow (a gradient flow with positive per-token rates) moves every such point closer to the
    minimum in the rates' metric, so it cannot leave. The test asks for it at ``start`` and at the midpoint towards
    ``found``, with ``c = 0.5 / sqrt(kappa)`` (``kappa`` the spread of the per-token rates, over which that metric and
    the Euclidean one differ), and that ``E`` decreases from ``start`` to ``found``; gradients are resolved to the
    certificate's RMS tolerance ``tol`` (rounding), which the allowed error includes. A point not of one geometry
    (``"mixed"``) or with ``lambda <= 0`` is never settled.
    """
    settled = torch.zeros(start.shape[0], dtype=torch.bool)
    for name in ("spheres", "x"):
        index = torch.nonzero(torch.tensor([k == name for k in geometry]) & (smallest > 0)).flatten()
        if not len(index):
            continue
        bound = field.select(index)
        if name == "spheres":
            settled[index] = _linear_regime(_Spheres(bound), start[index], found[index], smallest[index], tol)
        else:
            settled[index] = _linear_regime_in_g(bound, start[index], found[index], tol)
    return settled


def _downhill(field: ETField, g_start: Tensor, g_found: Tensor) -> Tensor:
    """``E`` does not rise from ``g_start`` to ``g_found`` (up to rounding), per sample ``(B,)``."""
    energy_start, energy_found = _energy(field, g_start), _energy(field, g_found)
    return energy_start >= energy_found - 1e-10 * energy_found.abs().clamp_min(1.0)


def _linear_regime_in_g(field: ETField, start: Tensor, found: Tensor, tol: float) -> Tensor:
    """:func:`basin_settled` at a fixed point in ``x``, ``(B,)``, made in ``g``: there the flow is
    ``dg/dt = -(1/tau) M dE/dg``, a gradient flow of ``E`` with the positive rates ``M`` on centred vectors, whose
    Hessian varies far less than that of ``E(LayerNorm(x))`` in ``x`` near a small token scale. The curvature is
    the Rayleigh quotient of ``H = d^2E/dg^2`` along the displacement (positive where ``M H M`` is, as certified);
    the rates' spread ``kappa`` is the neuron's ``conditioning`` (that of the tokens' ``1 / sigma_A`` for LayerNorm, 1
    for the identity)."""
    neuron = field.model.neuron
    margin = 0.5 / neuron.conditioning(start).sqrt()
    with torch.no_grad():
        g_start, g_found = neuron(start), neuron(found)
        settled = _downhill(field, g_start, g_found)
    with torch.enable_grad():
        point = g_found.detach().requires_grad_(True)
        grad_found = field.dE_dg(point)
    for fraction in (1.0, 0.5):
        v = neuron.project(fraction * (g_start - g_found))
        (hv,) = torch.autograd.grad(grad_found, point, v, retain_graph=True)
        hv = neuron.project(hv)
        field.count_evaluations(2)
        with torch.no_grad():
            grad = field.dE_dg(g_found + v)
        error = neuron.project(grad) - hv
        length = sample_dot(v, v).sqrt()
        curvature = sample_dot(v, hv) / length.square().clamp_min(torch.finfo(v.dtype).tiny)
        allowed = margin * curvature.clamp_min(0) * length + tol * math.sqrt(v[0].numel())
        settled &= (length == 0) | (sample_dot(error, error).sqrt() <= allowed)
    return settled


def _linear_regime(geometry: _Spheres, start: Tensor, found: Tensor, smallest: Tensor, tol: float) -> Tensor:
    """:func:`basin_settled` on the spheres, ``(B,)``. ``start`` is first put on the limit spheres (the flow's state
    lies inside them by ``O(eps / sigma^2)``, a radial offset the tangent displacement misses)."""
    field = geometry.field
    margin = 0.5 / field.model.neuron.conditioning(start).sqrt()
    start = geometry.canonical(start)
    with torch.no_grad():
        settled = _downhill(field, field.model.neuron(start), field.model.neuron(found))
    apply, _, project, _ = geometry.hessian(field, found)
    step = geometry.displacement(found, start)
    midpoint = geometry.retract(found, 0.5 * step)
    for point, v in ((start, step), (midpoint, geometry.displacement(found, midpoint))):
        with torch.no_grad():
            grad, _ = geometry.gradient(field, point)
        error = project(grad) - apply(v).detach()
        length = sample_dot(v, v).sqrt()
        near = length <= 1e3 * torch.finfo(v.dtype).eps * geometry.size(found)
        allowed = margin * smallest * length + tol * math.sqrt(v[0].numel())
        settled &= near | (sample_dot(error, error).sqrt() <= allowed)
    return settled


def _spectrum(field: ETField, search: _Search, *, lanczos_iterations: int, seed: int) -> tuple[Tensor, Tensor]:
    """Smallest and largest Ritz values of each sample's Hessian in its geometry (Lanczos), ``(B,)`` each."""
    x, (n, d) = search.x, search.x.shape[-2:]
    generator = torch.Generator().manual_seed(seed)
    smallest, largest = torch.empty(x.shape[0], dtype=x.dtype), torch.empty(x.shape[0], dtype=x.dtype)
    for name, geometry_class in (("spheres", _Spheres), ("x", _Euclidean)):
        selected = torch.tensor([k == name or (k == "mixed" and name == "spheres") for k in search.geometry])
        index = torch.nonzero(selected).flatten()
        if not len(index):
            continue
        bound = field.select(index)
        apply, _, project, _ = geometry_class(bound).hessian(bound, x[index])
        dimension = n * (d - 2) if name == "spheres" else n * bound.model.neuron.free_dimension()
        start = torch.randn(x[index].shape, generator=generator, dtype=x.dtype).to(x.device)
        ritz, _ = lanczos(apply, start, iterations=min(lanczos_iterations, dimension), project=project, generator=generator)
        smallest[index], largest[index] = ritz[:, 0].detach(), ritz[:, -1].detach()
    return smallest, largest


def _status(geometry: Geometry, converged: bool, kind: Kind, settled: bool) -> AttractorStatus:
    if geometry == "mixed":
        return "mixed"
    if not converged:
        return "not_converged"
    if kind != "stable":
        return kind
    return "certified" if settled else "unsettled"


# -- the polishing and its certificate --------------------------------------------------------------------------------


def examine(
    field: ETField,
    x: Tensor,
    *,
    tol: float,
    method: SearchMethod = "newton",
    max_iter: int = 200,
    cg_max_iter: int = 100,
    lanczos_iterations: int = 32,
    zero_tol: float = 1e-6,
    seed: int = 0,
    vouched: bool = False,
) -> Attractor:
    """Phases 2 and 3 of :func:`et_ode.find_attractor` on ``x`` ``(B, N, D)`` (flattened; validated by the caller;
    arguments as there): Newton to the critical point, its certificate, and the basin test from ``x``. With
    ``vouched`` the caller holds ``x`` to be in the point's basin (``find_attractor(..., flow=False)``): the status
    then does not wait on the basin test, whose answer ``settled`` still reports. The result's ``g`` is plain (not
    differentiable); its counts cover this call alone."""
    evaluations_before = field.nfe
    counters = {"energy": 0}
    options = dict(tol=tol, method=method, max_iter=max_iter, cg_max_iter=cg_max_iter)
    search = _search(field, x, options, counters)
    smallest, largest = _spectrum(field, search, lanczos_iterations=lanczos_iterations, seed=seed)
    with torch.no_grad():
        g = field.model.neuron(search.x)
        energy = _energy(field, g)
        spheres = field.model.neuron.geometry == "spheres"
        outward = token_forces(field, search.x).amin(dim=-1) if spheres else torch.full_like(energy, math.nan)
    kinds = tuple(
        _classify(float(lo), float(hi), zero_tol * max(abs(float(lo)), abs(float(hi)), 1e-300))
        for lo, hi in zip(smallest, largest, strict=True)
    )
    settled = basin_settled(field, x, search.x, smallest, search.geometry, tol=tol)
    converged = search.gradient < tol
    status = tuple(
        _status(geo, bool(c), kind, vouched or bool(s))
        for geo, c, kind, s in zip(search.geometry, converged, kinds, settled, strict=True)
    )
    return Attractor(
        x=search.x,
        g=g,
        energy=energy,
        gradient=search.gradient,
        smallest_eigenvalue=smallest,
        largest_eigenvalue=largest,
        kind=kinds,
        geometry=tuple(search.geometry),
        converged=converged,
        outward_force=outward,
        settled=settled,
        status=status,
        iterations=search.iterations,
        flow_evaluations=0,
        evaluations=field.nfe - evaluations_before,
        energy_evaluations=counters["energy"],
        tol=float(tol),
    )


def differentiable(
    field: ETField,
    found: Attractor,
    batch_shape: torch.Size,
    *,
    implicit_tol: float,
    implicit_max_iter: int,
    flow_evaluations: int,
    evaluations: int,
) -> Attractor:
    """``found`` (a flattened batch) reshaped to ``batch_shape``, with ``g`` differentiable by the implicit function
    theorem at its certified samples (:func:`et_ode.equilibrium.implicit.implicit_attractor`) and the given counts."""
    in_x = torch.tensor([k == "x" for k in found.geometry])
    g = implicit_attractor(
        field, found.x, in_x=in_x, certified=found.certified.reshape(-1), tol=implicit_tol, max_iter=implicit_max_iter
    )

    def shaped(v: Tensor) -> Tensor:
        return v.reshape((*batch_shape, *v.shape[1:]))  # (a tuple: an unbatched x0 has batch_shape ())

    per_sample: dict[str, Any] = {name: shaped(getattr(found, name)) for name in _PER_SAMPLE}
    return dataclasses.replace(found, g=shaped(g), flow_evaluations=flow_evaluations, evaluations=evaluations, **per_sample)


def check_lyapunov_neuron(field: ETField, who: str) -> None:
    """The LayerNorm neuron's ``gamma`` must be positive (its metric is then positive semi-definite, the energy a
    Lyapunov function): a ValueError saying that ``who`` needs it otherwise. Other neurons are the user's to make
    convex."""
    neuron = field.model.neuron
    if neuron.geometry == "spheres" and not float(sphere_neuron(neuron, who).gamma.detach()) > 0:
        raise ValueError(f"{who} needs gamma > 0 (the energy is then a Lyapunov function)")


def certify(
    field: ETField,
    x: Tensor,
    *,
    tol: float,
    flow: bool = False,
    implicit_tol: float = 1e-8,
    implicit_max_iter: int = 200,
    **newton: Any,
) -> Attractor:
    """:func:`settle` on ``x`` ``(*batch, N, D)`` (validated by the caller), with ``g`` differentiable where the point
    is certified. ``flow=False`` examines ``x`` itself (held to be in its basin); ``flow=True`` flows on from it
    where the basin is not settled. ``newton`` holds :func:`examine`'s other arguments."""
    check_lyapunov_neuron(field, "an attractor")
    evaluations_before = field.nfe
    flat, flat_field = flatten(field, x)
    found, flow_evaluations = settle(
        flat_field, flat, flow=flow, handoff=HANDOFF, handoffs=HANDOFFS, phase=FlowPhase(), tol=tol, **newton
    )
    return differentiable(
        flat_field,
        found,
        x.shape[:-2],
        implicit_tol=implicit_tol,
        implicit_max_iter=implicit_max_iter,
        flow_evaluations=flow_evaluations,
        evaluations=field.nfe - evaluations_before,
    )


def combine(parts: list[tuple[Tensor, Attractor]], batch: int) -> Attractor:
    """One flattened :class:`Attractor` of ``batch`` samples from results on subsets ``(index, part)``; a later part
    overrides an earlier one at the samples it holds. Counts add up."""
    first = parts[0][1]
    tensors = {
        name: torch.empty((batch, *getattr(first, name).shape[1:]), dtype=getattr(first, name).dtype)
        for name in ("g", *_PER_SAMPLE)
    }
    labels: dict[str, list[Any]] = {name: [None] * batch for name in ("kind", "geometry", "status")}
    for index, part in parts:
        for name, value in tensors.items():
            value[index] = getattr(part, name)
        for name, values in labels.items():
            for i, label in zip(index.tolist(), getattr(part, name), strict=True):
                values[i] = label
    return Attractor(
        **tensors,
        kind=tuple(labels["kind"]),
        geometry=tuple(labels["geometry"]),
        status=tuple(labels["status"]),
        flow_evaluations=sum(p.flow_evaluations for _, p in parts),
        evaluations=sum(p.evaluations for _, p in parts),
        energy_evaluations=sum(p.energy_evaluations for _, p in parts),
        tol=first.tol,
    )


# -- the flow phase and the hand-off --------------------------------------------------------------------------------


def flow_to(
    field: ETField,
    x: Tensor,
    *,
    handoff: float,
    phase: FlowPhase,
    watch: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ET's flow per sample from ``x`` ``(B, N, D)`` until RMS ``|T dE/dg| <= handoff``, in segments of
    ``phase.segment * tau`` between common rescalings; a sample that has not got there after ``phase.max_segments``
    segments stops where it is, and so does one whose segment needs more than :data:`FLOW_MAX_STEPS` steps (a stiff
    flow, e.g. a token shrinking through ``x = 0``). After each segment ``watch(index, x[index])`` (when given) is asked
    about the samples ``index`` still flowing, and those it answers True for ``(len(index),)`` stop there. Returns
    the states, which samples ``watch`` stopped ``(B,)`` and which exhausted the step budget ``(B,)``. Raises
    :class:`~et_ode.SolveError` where the integration fails otherwise (a non-finite state)."""
    x = x.detach().clone()
    active = torch.arange(x.shape[0])
    watched = torch.zeros(x.shape[0], dtype=torch.bool)
    exhausted = torch.zeros(x.shape[0], dtype=torch.bool)
    span = phase.segment * field.tau
    grid = torch.tensor([0.0, span], dtype=torch.float64, device=x.device)
    step_control: Literal["shared", "per_sample"] = "per_sample" if cuts_per_sample(field.mask) else "shared"
    solver = Adaptive(rtol=phase.rtol, atol=phase.atol, step_control=step_control)
    stop = SteadyState(handoff, measure="tangent_gradient", per_sample=True)
    for _ in range(phase.max_segments):
        if not len(active):
            break
        states = shrink_scale(x[active]) if field.model.neuron.geometry == "spheres" else x[active]
        moved, stop_times, failed = _flow_segment(field.select(active), states, grid, solver, stop)
        x[active[~failed]] = moved[~failed]
        exhausted[active[failed]] = True
        active = active[~failed & (stop_times >= span)]
        if watch is not None and len(active):
            done = watch(active, x[active])
            watched[active[done]] = True
            active = active[~done]
    return x, watched, exhausted


def _flow_segment(
    field: ETField, x: Tensor, grid: Tensor, solver: Adaptive, stop: SteadyState
) -> tuple[Tensor, Tensor, Tensor]:
    """One segment of :func:`flow_to` for ``x`` ``(B, N, D)``: the end states, the stop times ``(B,)`` and which
    samples exhausted :data:`FLOW_MAX_STEPS` ``(B,)`` (a batch that exhausts it is flowed one sample at a time, so
    that only the stiff samples stop). SolveError on any other failure."""
    problem = Problem(field, x, grid, solver, stop, "final", FLOW_MAX_STEPS)
    try:
        with torch.no_grad():
            result = integrate(problem, odeint, problem.torchdiffeq_arguments())
    except SolverFailure as failure:
        if failure.advice != BUDGET_ADVICE:
            raise SolveError(
                f"the flow phase failed: {failure}; {failure.advice}", time=failure.time, solution=None
            ) from failure
        if x.shape[0] == 1:
            return x, grid[-1:].clone(), torch.ones(1, dtype=torch.bool, device=x.device)
        parts = [_flow_segment(field.select(torch.tensor([i])), x[i : i + 1], grid, solver, stop) for i in range(len(x))]
        return tuple(torch.cat(part) for part in zip(*parts, strict=True))  # type: ignore[return-value]
    assert result.stop_times is not None  # a per-sample stop records each sample's stop time (``span`` if none)
    return result.x, result.stop_times, torch.zeros(len(x), dtype=torch.bool, device=x.device)


def _take(found: Attractor, index: Tensor, *, settled: bool = False) -> Attractor:
    """The samples ``index`` of a flattened ``found``, with no counts of their own; with ``settled``, marked settled
    and certified (a later basin test, from further along the flow, tied them to the flow)."""
    per_sample = {name: getattr(found, name)[index] for name in ("g", *_PER_SAMPLE)}
    labels: dict[str, Any] = {
        name: tuple(getattr(found, name)[i] for i in index.tolist()) for name in ("kind", "geometry", "status")
    }
    if settled:
        per_sample["settled"] = torch.ones_like(per_sample["settled"])
        labels["status"] = ("certified",) * len(index)
    return dataclasses.replace(found, **per_sample, **labels, flow_evaluations=0, evaluations=0, energy_evaluations=0)


def _basin_watch(field: ETField, candidates: Attractor, tol: float) -> Callable[[Tensor, Tensor], Tensor]:
    """The flow phase's watch for the samples whose last examination found a converged stable point that the basin
    test could not yet tie to the flow (status ``"unsettled"``): whether the flow, at ``x``, is in its basin
    (:func:`basin_settled`), so that it stops there instead of at the next hand-off level."""
    waiting = torch.tensor([status == "unsettled" for status in candidates.status], dtype=torch.bool)

    def watch(index: Tensor, x: Tensor) -> Tensor:
        settled = torch.zeros(len(index), dtype=torch.bool)
        asked = torch.nonzero(waiting[index]).flatten()
        if len(asked):
            chosen = index[asked]
            geometry = [candidates.geometry[i] for i in chosen.tolist()]
            smallest = candidates.smallest_eigenvalue[chosen]
            found = candidates.x[chosen]
            settled[asked] = basin_settled(field.select(chosen), x[asked], found, smallest, geometry, tol=tol)
        return settled

    return watch


def settle(
    field: ETField,
    x: Tensor,
    *,
    flow: bool,
    handoff: float,
    handoffs: int,
    phase: FlowPhase,
    **newton: Any,
) -> tuple[Attractor, int]:
    """The hand-off loop of :func:`et_ode.find_attractor` on a flattened batch ``(B, N, D)``: flow to the hand-off
    level, :func:`examine` there, and flow on to a level ten times lower the samples that are not certified, for
    ``handoffs`` levels at most (``flow=False``: one examination of ``x`` itself). A sample whose examination found a
    converged stable point the basin test could not yet tie to the flow is watched between the flow's segments: once
    the flow is in that point's basin (:func:`basin_settled`) it is certified there, without flowing on to the next
    level or examining again. A sample whose flow exhausts the step budget (:func:`flow_to`) is examined where it
    stopped and not flowed on: it keeps the status of that examination. ``phase`` is how the flow integrates,
    ``newton`` holds :func:`examine`'s arguments. Returns the combined result (plain ``g``) and the flow's field
    evaluations (the watch's included)."""
    pending = torch.arange(x.shape[0])
    parts: list[tuple[Tensor, Attractor]] = []
    flow_evaluations, level = 0, handoff
    candidates: Attractor | None = None  # the last examination of the pending samples
    x = x.detach().clone()
    for _ in range(handoffs if flow else 1):
        early = exhausted = torch.zeros(len(pending), dtype=torch.bool)
        if flow:
            bound = field.select(pending)
            watch = None if candidates is None else _basin_watch(bound, candidates, newton["tol"])
            flow_started = field.nfe
            x[pending], early, exhausted = flow_to(
                bound,
                x[pending],
                handoff=level,
                phase=phase,
                watch=watch,
            )
            flow_evaluations += field.nfe - flow_started
        if bool(early.any()):
            assert candidates is not None  # (only a watch stops a sample early)
            parts.append((pending[early], _take(candidates, torch.nonzero(early).flatten(), settled=True)))
        pending = pending[~early]
        if not len(pending):
            break
        found = examine(field.select(pending), x[pending], vouched=not flow, **newton)
        parts.append((pending, found))
        unsettled = torch.nonzero(~found.certified & ~exhausted[~early]).flatten()  # a stiff flow is not followed on
        pending, candidates = pending[unsettled], _take(found, unsettled)
        if not len(pending):
            break
        level /= 10
    return combine(parts, x.shape[0]), flow_evaluations
