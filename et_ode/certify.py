"""Phases 2 and 3 of :func:`et_ode.find_attractor`: from a state in its basin, trust-region Riemannian Newton to the
critical point (``certify``), and its certificate, an :class:`Attractor` (see :mod:`et_ode.attractor` for the method).
This module does not integrate the flow, so that the implicit gradient of :func:`et_ode.solve`
(:class:`et_ode.Implicit`) can polish a solve's end state here without importing ``solve`` back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .field import ETField
from .gradients import implicit_attractor
from .krylov import lanczos
from .manifold import euclidean_hessian, radial_direction, riemannian_hessian, tangent_projection

METHODS = ("newton", "gradient")


@dataclass(frozen=True)
class Attractor:
    """What :func:`et_ode.find_attractor` returns (per-sample entries have shape ``(*batch,)``).

    Attributes:
        x: the state ``(*batch, N, D)``, detached (on the spheres: at the scale described in the module docstring).
        g: ``LayerNorm(x)``, ``(*batch, N, D)``; differentiable with respect to the model's parameters (implicit).
        energy: ``E`` per sample.
        gradient: the certificate's residual: RMS ``|T dE/dg|`` on the spheres, RMS ``|M dE/dg|`` (the
            gradient of ``E(LayerNorm(x))``) for ``geometry="x"``.
        smallest_eigenvalue: smallest eigenvalue of the Riemannian Hessian on the tangent space (spheres), or of
            the Hessian of ``E(LayerNorm(x))`` on centred ``x`` (geometry ``"x"``), by Lanczos.
        largest_eigenvalue: the largest, from the same Lanczos run (sets the zero tolerance of ``kind``).
        kind: ``"stable"``, ``"saddle"`` or ``"degenerate"`` per sample (a tuple, flattened batch order).
        geometry: ``"spheres"`` or ``"x"`` per sample.
        converged: the residual is below ``tol``, per sample.
        outward_force: the smallest ``rho_A = -s_A . dE/dg_A`` over the tokens, per sample.
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
    kind: tuple[str, ...]
    geometry: tuple[str, ...]
    converged: Tensor
    outward_force: Tensor
    iterations: Tensor
    flow_evaluations: int
    evaluations: int
    energy_evaluations: int
    tol: float

    @property
    def certified(self) -> Tensor:
        """Converged and stable, per sample ``(*batch,)``: the points whose gradient is defined."""
        stable = torch.tensor([k == "stable" for k in self.kind], device=self.converged.device)
        return self.converged & stable.reshape(self.converged.shape)


def default_tol(dtype: torch.dtype) -> float:
    """``1e-8`` in float64, ``1e-4`` in float32 (a few hundred rounding units of ``dE/dg``), ``10 eps`` below."""
    if dtype == torch.float64:
        return 1e-8
    return 1e-4 if dtype == torch.float32 else 10 * torch.finfo(dtype).eps


def limit_scale(eps: float, dtype: torch.dtype) -> float:
    """The token scale ``S`` (``mean(xt^2) = S^2``) at which ``eps / S^2`` is below the rounding unit."""
    return max(1.0, 4.0 * math.sqrt(eps / torch.finfo(dtype).eps))


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample inner product ``(B, N, D) x (B, N, D) -> (B,)``."""
    return (a * b).sum(dim=(-1, -2))


def _col(v: Tensor) -> Tensor:
    return v[:, None, None]


# -- the two geometries -------------------------------------------------------------------------------------------


class _Spheres:
    """Critical points of ``E`` on the product of spheres; tangent vectors in ``g`` coordinates."""

    name = "spheres"

    def __init__(self, field: ETField):
        self.field = field
        neuron = field.model.neuron
        self.delta, self.eps = neuron.delta.detach(), neuron.eps
        self.gamma = float(neuron.gamma.detach())

    def canonical(self, x: Tensor) -> Tensor:
        """Centre every token and scale it to ``mean(xt^2) = S^2`` (same ``g`` direction, limit radius)."""
        xt = x - x.mean(dim=-1, keepdim=True)
        rms = xt.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(torch.finfo(x.dtype).tiny)
        return xt * (limit_scale(self.eps, x.dtype) / rms)

    def gradient(self, field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(T dE/dg, g)`` at ``x``."""
        g = field.model.neuron(x)
        field.count_evaluations()
        s, _ = radial_direction(g, self.delta)
        return tangent_projection(field.dE_dg(g), s), g

    def hessian(self, field: ETField, x: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor, Callable[[Tensor], Tensor]]:
        """``(Hess_R, T dE/dg, T)`` at ``x``."""
        g = field.model.neuron(x).detach()
        field.count_evaluations()
        apply, tangent = riemannian_hessian(field, g)
        s, _ = radial_direction(g, self.delta)
        return apply, tangent, lambda w: tangent_projection(w, s)

    def size(self, x: Tensor) -> Tensor:
        """The length scale of a step per sample (the largest trust region): ``gamma sqrt(N D)``."""
        return torch.full(x.shape[:1], self.gamma * math.sqrt(x[0].numel()), dtype=x.dtype, device=x.device)

    def retract(self, x: Tensor, step: Tensor) -> Tensor:
        """Move ``g`` by the tangent ``step`` and project back: ``xt <- xt + (sigma / gamma) step``."""
        xt = x - x.mean(dim=-1, keepdim=True)
        sigma = xt.square().mean(dim=-1, keepdim=True).add(self.eps).sqrt()
        return self.canonical(xt + sigma / self.gamma * step)


class _Euclidean:
    """Critical points of ``F(x) = E(LayerNorm(x))`` over centred ``x``: fixed points of the flow in ``x``."""

    name = "x"

    def __init__(self, field: ETField):
        self.field = field
        self.neuron = field.model.neuron

    @staticmethod
    def canonical(x: Tensor) -> Tensor:
        return x - x.mean(dim=-1, keepdim=True)

    def gradient(self, field: ETField, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(dF/dx = M dE/dg, g)`` at ``x``."""
        g = self.neuron(x)
        field.count_evaluations()
        return self.neuron.hessian_vector(x, field.dE_dg(g)), g

    def hessian(self, field: ETField, x: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor, Callable[[Tensor], Tensor]]:
        """``(Hess F, dF/dx, centring)`` at ``x`` (:func:`et_ode.manifold.euclidean_hessian`)."""
        field.count_evaluations()
        apply, gradient = euclidean_hessian(field, x)
        return apply, gradient, self.canonical

    def size(self, x: Tensor) -> Tensor:
        """The length scale of a step per sample (the largest trust region): the norm of the centred ``x``."""
        return self.canonical(x).flatten(1).norm(dim=1).clamp_min(torch.finfo(x.dtype).eps)

    @staticmethod
    def retract(x: Tensor, step: Tensor) -> Tensor:
        return x + step


# -- trust-region Newton with truncated conjugate gradients -------------------------------------------------------


def _to_boundary(p: Tensor, d: Tensor, radius: Tensor) -> Tensor:
    """The ``tau >= 0`` with ``|p + tau d| = radius`` per sample."""
    dd, pd, pp = _dot(d, d), _dot(p, d), _dot(p, p)
    disc = (pd.square() + dd * (radius.square() - pp)).clamp_min(0)
    return (-pd + disc.sqrt()) / dd.clamp_min(torch.finfo(p.dtype).tiny)


def _steihaug(apply: Callable[[Tensor], Tensor], grad: Tensor, radius: Tensor, *, forcing: Tensor,
              max_iter: int) -> tuple[Tensor, Tensor]:
    """Approximately minimize ``m(p) = grad . p + p . H p / 2`` per sample within ``|p| <= radius``.

    Steihaug's truncated conjugate gradients: stop at the boundary, along a direction of non-positive
    curvature (to the boundary: the way down from a saddle), or once the residual is below ``forcing``.
    Returns the step and the predicted decrease ``-m(p)`` per sample.
    """
    p = torch.zeros_like(grad)
    hp = torch.zeros_like(grad)
    r = grad.clone()
    d = -r
    rr = _dot(r, r)
    done = rr.sqrt() <= forcing
    for _ in range(max_iter):
        if bool(done.all()):
            break
        hd = apply(d)
        curvature = _dot(d, hd)
        alpha = rr / torch.where(curvature > 0, curvature, torch.ones_like(curvature))
        p_next = p + _col(alpha) * d
        boundary = ~done & ((curvature <= 0) | (_dot(p_next, p_next).sqrt() >= radius))
        tau = _to_boundary(p, d, radius)
        step = torch.where(boundary, tau, torch.where(done, torch.zeros_like(alpha), alpha))
        p = p + _col(step) * d
        hp = hp + _col(step) * hd
        r = r + _col(step) * hd
        rr_next = _dot(r, r)
        done = done | boundary | (rr_next.sqrt() <= forcing)
        d = torch.where(_col(done), d, -r + _col(rr_next / rr.clamp_min(torch.finfo(rr.dtype).tiny)) * d)
        rr = rr_next
    predicted = -(_dot(grad, p) + 0.5 * _dot(p, hp))
    return p, predicted


def _energy(field: ETField, g: Tensor) -> Tensor:
    return field.model.energy_g(g, field.mask)


def _descend(geometry: _Spheres | _Euclidean, field: ETField, x: Tensor, *, tol: float, method: str,
             max_iter: int, cg_max_iter: int, counters: dict[str, int]) -> tuple[Tensor, Tensor, Tensor]:
    """Trust-region Newton (or Riemannian gradient descent) per sample until its RMS gradient is below ``tol``.

    Newton: Steihaug's step, accepted when the ratio of actual to predicted decrease of ``E`` exceeds 1e-4; the
    radius doubles after a good step to the boundary (ratio > 0.75), shrinks to a quarter of a poor step's length
    (ratio < 0.25). Gradient descent: ``-step * grad`` with an Armijo test, the step grown by 1.5 or halved. Once
    the predicted decrease is below the rounding of ``E``, a step is accepted when it reduces the gradient. A
    sample whose trust radius collapses falls back to gradient descent; one whose step underflows stops there.
    Samples leave the batch when they finish. Returns the states, the RMS gradients and the iterations per sample.
    """
    batch, size = x.shape[0], x[0].numel()
    rounding, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
    x = geometry.canonical(x)
    per_sample_mask = field.mask if isinstance(field.mask, Tensor) and field.mask.dim() == 3 else None
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
        bound = field.with_mask(per_sample_mask[active]) if per_sample_mask is not None else field
        xa = x[active]
        newton = ~fallback[active]
        if bool(newton.any()):
            apply, grad, project = geometry.hessian(bound, xa)
        else:
            with torch.no_grad():
                grad, _ = geometry.gradient(bound, xa)
        norm = _dot(grad, grad).sqrt()
        rms[active] = norm / math.sqrt(size)
        done = (rms[active] < tol) | (iterations[active] >= max_iter)
        if bool(done.all()):
            break
        trial_step = -_col(step[active]) * grad
        predicted = step[active] * norm.square()
        if bool(newton.any()):  # finished samples ride along this once, frozen (an infinite forcing term)
            forcing = torch.where(done | ~newton, torch.full_like(norm, math.inf), norm * norm.clamp(max=0.1))
            p, newton_predicted = _steihaug(apply, grad, radius[active], forcing=forcing,
                                            max_iter=cg_max_iter)
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
                trial_norm = _dot(trial_grad, trial_grad).sqrt()
        ratio = actual / predicted.clamp_min(tiny)
        accept = torch.where(below, trial_norm < norm, torch.where(newton, ratio > 1e-4, actual >= 1e-4 * predicted))
        accept = accept & ~done
        x[active] = torch.where(_col(accept), trial, xa)
        energy[active] = torch.where(accept, trial_energy, energy[active])
        length, r = _dot(trial_step, trial_step).sqrt(), radius[active]
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


def _classify(smallest: float, largest: float, zero_tol: float) -> str:
    if smallest > zero_tol:
        return "stable"
    return "saddle" if smallest < -zero_tol else "degenerate"


def _outward_force(field: ETField, x: Tensor) -> Tensor:
    """The smallest ``rho_A = -s_A . dE/dg_A`` over the tokens, per sample ``(B,)``."""
    g = field.model.neuron(x)
    s, _ = radial_direction(g, field.model.neuron.delta.detach())
    field.count_evaluations()
    return -(s * field.dE_dg(g)).sum(dim=-1).amin(dim=-1)


# -- the polishing and its certificate --------------------------------------------------------------------------------


def flatten(field: ETField, x: Tensor) -> tuple[Tensor, ETField]:
    """``x`` ``(*batch, N, D)`` as ``(B, N, D)`` (detached, a copy) and ``field`` bound to its mask expanded to match
    (``(B, N, N)`` for a per-sample mask)."""
    batch_shape, (n, d) = x.shape[:-2], x.shape[-2:]
    mask = field.mask
    if isinstance(mask, Tensor) and mask.dim() > 2:
        mask = mask.expand(*batch_shape, n, n).reshape(-1, n, n)
    return x.detach().reshape(-1, n, d).clone(), field.with_mask(mask)


def certify(field: ETField, x: Tensor, *, tol: float, method: str = "newton", max_iter: int = 200,
            cg_max_iter: int = 100, lanczos_iterations: int = 32, zero_tol: float = 1e-6, implicit_tol: float = 1e-10,
            implicit_max_iter: int = 500, seed: int = 0, flow_evaluations: int = 0,
            evaluations_before: int | None = None) -> Attractor:
    """Phases 2 and 3 of :func:`et_ode.find_attractor` from ``x`` ``(*batch, N, D)``, a state already in its basin
    (validated by the caller; arguments as there): Newton to the critical point, then its certificate. The result's
    ``g`` is differentiable by the implicit function theorem where the point is certified stable.
    ``flow_evaluations`` and ``evaluations_before`` (the field's ``nfe`` before the flow) are the caller's flow
    phase, for the counts."""
    evaluations_before = field.nfe if evaluations_before is None else evaluations_before
    if not float(field.model.neuron.gamma.detach()) > 0:
        raise ValueError("an attractor needs gamma > 0 (the energy is then a Lyapunov function)")
    batch_shape, (n, d) = x.shape[:-2], x.shape[-2:]
    x, field = flatten(field, x)
    mask = field.mask
    batch = x.shape[0]
    counters = {"energy": 0}
    with torch.no_grad():
        inward = _outward_force(field, x) <= 0
    spheres, euclidean = _Spheres(field), _Euclidean(field)
    geometry = ["x" if bool(b) else "spheres" for b in inward]
    start = x.clone()
    result_x = torch.empty_like(x)
    gradient = torch.empty(batch, dtype=x.dtype)
    iterations = torch.zeros(batch, dtype=torch.long)

    def run(kind: str, index: Tensor, states: Tensor) -> None:
        if not len(index):
            return
        geo = spheres if kind == "spheres" else euclidean
        bound = field.with_mask(mask[index]) if isinstance(mask, Tensor) and mask.dim() == 3 else field
        found, rms, its = _descend(geo, bound, states, tol=tol, method=method, max_iter=max_iter,
                                   cg_max_iter=cg_max_iter, counters=counters)
        result_x[index], gradient[index], iterations[index] = found, rms, iterations[index] + its

    on_spheres = torch.tensor([k == "spheres" for k in geometry])
    run("spheres", torch.nonzero(on_spheres).flatten(), x[on_spheres])
    with torch.no_grad():
        leaving = on_spheres & (_outward_force(field, result_x) <= 0)
    for i in torch.nonzero(leaving).flatten().tolist():
        geometry[i] = "x"
    in_x = torch.tensor([k == "x" for k in geometry])
    run("x", torch.nonzero(in_x).flatten(), start[in_x])

    # certificate
    generator = torch.Generator().manual_seed(seed)
    smallest = torch.empty(batch, dtype=x.dtype)
    largest = torch.empty(batch, dtype=x.dtype)
    for kind, selected in (("spheres", ~in_x), ("x", in_x)):
        index = torch.nonzero(selected).flatten()
        if not len(index):
            continue
        geo = spheres if kind == "spheres" else euclidean
        bound = field.with_mask(mask[index]) if isinstance(mask, Tensor) and mask.dim() == 3 else field
        apply, _, project = geo.hessian(bound, result_x[index])
        dimension = n * (d - 2) if kind == "spheres" else n * (d - 1)
        start = torch.randn(result_x[index].shape, generator=generator, dtype=x.dtype).to(x.device)
        ritz, _ = lanczos(apply, start, iterations=min(lanczos_iterations, dimension), project=project,
                          generator=generator)
        smallest[index], largest[index] = ritz[:, 0].detach(), ritz[:, -1].detach()
    with torch.no_grad():
        g = field.model.neuron(result_x)
        energy = _energy(field, g)
        outward = _outward_force(field, result_x)
    kinds = tuple(_classify(float(smallest[b]), float(largest[b]), zero_tol * max(abs(float(smallest[b])),
                                                                                  abs(float(largest[b])), 1e-300))
                  for b in range(batch))
    converged = gradient < tol
    g = implicit_attractor(field, result_x, in_x=in_x, certified=converged & torch.tensor([k == "stable" for k in kinds]),
                           tol=implicit_tol, max_iter=implicit_max_iter)
    evaluations = field.nfe - evaluations_before

    def shaped(v: Tensor) -> Tensor:
        return v.reshape(*batch_shape, *v.shape[1:])

    return Attractor(x=shaped(result_x), g=shaped(g), energy=shaped(energy), gradient=shaped(gradient),
                     smallest_eigenvalue=shaped(smallest), largest_eigenvalue=shaped(largest), kind=kinds,
                     geometry=tuple(geometry), converged=shaped(converged), outward_force=shaped(outward),
                     iterations=shaped(iterations), flow_evaluations=flow_evaluations, evaluations=evaluations,
                     energy_evaluations=counters["energy"], tol=float(tol))
