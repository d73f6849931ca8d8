"""Where the attractors live: each normalized token on a sphere, and the Hessian along it.

``g_A - delta`` has zero mean and norm ``gamma sqrt(D) |xt| / sqrt(|xt|^2 + D eps)``: up to O(eps)
it lies on the sphere of radius ``r = gamma sqrt(D)`` in the centered subspace. The energy almost
always decreases outward (``s_A . dE/dg_A < 0``, ``s_A`` the unit radial direction), so along a
trajectory ``x`` keeps drifting: along the all-ones vector (the exact zero mode of ``M``) and
radially (``|xt|`` grows about linearly in time, the radial eigenvalue ``gamma eps / sigma^3`` of ``M``
vanishes, and the tangential rate ``gamma / sigma`` decays like ``1/t``). ``g`` converges, at a
rate set by the time change ``ds = gamma / (tau sigma) dt``, to a critical point of ``E`` on the
product of spheres. Its stability, and the implicit gradient through it, are read from the
Riemannian Hessian of ``E`` on those spheres, per token:

    Hess_R w = T (H w) - (s . dE/dg) / r * w        for tangent ``w`` (T removes mean and radial part),

whose curvature term is what the Euclidean ``M^(1/2) H M^(1/2)`` misses.

A neuron of Euclidean geometry (:class:`~et_ode.energy.neurons.IdentityNeuron` or one of the user's) has its
attractors at fixed points in ``x``, read from the Hessian of ``F(x) = E(g(x))`` (:func:`euclidean_hessian`), as
have the LayerNorm neuron's fixed points at a finite token scale.
Shapes: ``(..., N, D)`` throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from et_ode.dynamics.field import ETField
from et_ode.energy.neurons import radial_direction, sphere_neuron, tangent_projection

__all__ = [
    "euclidean_hessian",
    "limit_scale",
    "radial_direction",
    "retract",
    "riemannian_hessian",
    "shrink_scale",
    "tangent_projection",
    "to_limit_spheres",
]


def limit_scale(eps: float, dtype: torch.dtype) -> float:
    """The token scale ``S`` (``mean(xt^2) = S^2``) at which ``eps / S^2`` is below the rounding unit of ``dtype``:
    there ``LayerNorm(x)`` lies on the flow's limit spheres (radius ``gamma sqrt(D)``) to rounding."""
    return max(1.0, 4.0 * math.sqrt(eps / torch.finfo(dtype).eps))


def to_limit_spheres(x: Tensor, eps: float) -> Tensor:
    """Centre every token of ``x`` ``(..., N, D)`` and scale it to ``mean(xt^2) = S^2``, ``S =``
    :func:`limit_scale`: the same direction of ``g - delta``, with ``g = LayerNorm(x)`` on the flow's limit sphere
    of radius ``gamma sqrt(D)`` (to rounding). The one placement of a point on the spheres."""
    xt = x - x.mean(dim=-1, keepdim=True)
    rms = xt.square().mean(dim=-1, keepdim=True).sqrt().clamp_min(torch.finfo(x.dtype).tiny)
    return xt / rms * limit_scale(eps, x.dtype)  # a token with no centred part stays at 0 (its g at delta)


def retract(x: Tensor, step: Tensor, gamma: float | Tensor, eps: float) -> Tensor:
    """Move ``g = LayerNorm(x)`` by the tangent ``step`` (``g`` units, ``(..., N, D)``) and put every token back on
    its limit sphere: ``to_limit_spheres(xt + (sigma / gamma) step)`` (``sigma / gamma`` turns a tangent change of
    ``g`` into one of ``x``)."""
    xt = x - x.mean(dim=-1, keepdim=True)
    sigma = xt.square().mean(dim=-1, keepdim=True).add(eps).sqrt()
    return to_limit_spheres(xt + sigma / gamma * step, eps)


def shrink_scale(x: Tensor) -> Tensor:
    """Shrink each sample of ``x`` ``(B, N, D)`` by one common factor so that its tokens' RMS scale is at most 1:
    a time change of the flow (the path of ``g`` is kept, up to ``O(eps)``) that undoes the slow-down of the outward
    drift before a flow is continued. Never grown: a flow heading inward, to a fixed point in ``x``, is left alone."""
    xt = x - x.mean(dim=-1, keepdim=True)
    rms = xt.square().mean(dim=(-1, -2), keepdim=True).sqrt()
    return x / rms.clamp_min(1.0)


def riemannian_hessian(field: ETField, g: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """The operator ``w -> Hess_R w`` at ``g`` (Hessian-vector products by autograd of the field's
    ``dE/dg``, never forming the matrix), and the tangent projection of ``dE/dg`` (zero at a critical point).

    The returned operator is symmetric on the tangent space and maps into it.

    Raises:
        ValueError: the field's neuron is not of geometry ``"spheres"`` (naming it).
    """
    neuron = sphere_neuron(field.model.neuron, "the Riemannian Hessian on the spheres")
    s, radius = radial_direction(g.detach(), neuron.delta.detach())
    with torch.enable_grad():
        point = g.detach().requires_grad_(True)
        grad_e = field.dE_dg(point)
    curvature = ((grad_e.detach() * s).sum(dim=-1, keepdim=True) / radius).detach()

    def apply(w: Tensor) -> Tensor:
        w = tangent_projection(w, s)
        (hw,) = torch.autograd.grad(grad_e, point, w, retain_graph=True)
        field.count_evaluations()
        return tangent_projection(hw, s) - curvature * w

    return apply, tangent_projection(grad_e.detach(), s)


def euclidean_hessian(field: ETField, x: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor, Tensor]:
    """The Hessian of ``F(x) = E(g(x))`` as an operator on the vectors the neuron's :meth:`~et_ode.Neuron.project`
    keeps (centred ``x`` for LayerNorm, every ``x`` for the identity), ``dF/dx = M dE/dg``, and the ``dE/dg`` behind
    both (one evaluation for all three).

    ``Hess F u = M H M u + d/dx[M(x) c] u`` with ``c = dE/dg`` held fixed (the third derivative of the
    Lagrangian, by autograd of the neuron's ``hessian_vector``). Where ``x`` is a fixed point of the flow
    (``dE/dg`` in the directions every ``M`` annihilates only) the second term vanishes and
    ``Hess F = M H M``, congruent to the flow's Jacobian ``-(1/tau) H M`` there: the same inertia.
    The operator is symmetric and maps the projected vectors to projected vectors.
    """
    x = x.detach()
    neuron = field.model.neuron
    with torch.enable_grad():
        point = neuron(x).detach().requires_grad_(True)
        grad_e = field.dE_dg(point)
        state = x.clone().requires_grad_(True)
        gradient = neuron.hessian_vector(state, grad_e.detach())

    def apply(u: Tensor) -> Tensor:
        u = neuron.project(u)
        (h_mu,) = torch.autograd.grad(grad_e, point, neuron.hessian_vector(x, u), retain_graph=True)
        field.count_evaluations()
        out = neuron.hessian_vector(x, h_mu.detach())
        if gradient.requires_grad:  # M varies with x (not for the identity neuron)
            (third,) = torch.autograd.grad(gradient, state, u, retain_graph=True, allow_unused=True)
            out = out if third is None else out + third.detach()
        return neuron.project(out)

    return apply, gradient.detach(), grad_e.detach()
