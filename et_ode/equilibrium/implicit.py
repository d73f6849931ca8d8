"""Implicit differentiation at a fixed point of the g-dynamics (as deep equilibrium models do).

The ET converges in ``g`` to a critical point of ``E`` on a sphere per token (see ``manifold``):
``T dE/dg(g*) = 0`` with ``T`` the tangent projection. Differentiating that condition gives, for a
loss ``L(g*)`` with ``v = dL/dg*``,

    dL/dtheta = v . d LayerNorm/dtheta  -  w . d/dtheta [dE/dg(LayerNorm(x*; theta); theta)],
    Hess_R w = T v,

with ``Hess_R`` the Riemannian Hessian of ``E`` on the spheres. It is symmetric, and positive
definite on the tangent space exactly when the point is a stable attractor, so conjugate gradients
solve it with Hessian-vector products, never forming a matrix. Memory and cost do not depend on how many
steps the forward solve took. The fixed point does not depend on ``x0`` locally: ``x0`` gets no gradient.
At a fixed point in ``x`` (a neuron of Euclidean geometry, or the LayerNorm neuron's finite-scale points) the same
holds with the Hessian of ``E(g(x))`` in ``x`` (:func:`implicit_attractor`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from et_ode.dynamics.field import ETField
from et_ode.dynamics.manifold import euclidean_hessian, radial_direction, riemannian_hessian, tangent_projection
from et_ode.energy.neurons import sphere_neuron
from et_ode.linalg.krylov import conjugate_gradient, token_dot


class AttractorError(RuntimeError):
    """A gradient asked of a point that is not a certified stable attractor (or the search failed)."""


def default_implicit_tol(dtype: torch.dtype) -> float:
    """The conjugate-gradient solve's default relative residual: ``1e-8`` in float64, ``1e-3`` in float32 and below,
    where the rounding of the Hessian-vector products stalls conjugate gradients between about 1e-6 and 1e-4
    relative (a float64 tolerance is out of reach there: the solve would run all its iterations and warn)."""
    return 1e-8 if dtype == torch.float64 else 1e-3


def _solve_hessian_system(apply: Any, rhs: Tensor, *, tol: float, max_iter: int, advice: str) -> Tensor:
    """``w`` with ``apply(w) = rhs`` by conjugate gradients; a RuntimeWarning (ending in ``advice``) where the relative
    residual of any sample stays above ``tol``."""
    w, iterations, residual = conjugate_gradient(apply, rhs, tol=tol, max_iter=max_iter)
    if bool((residual > tol).any()):
        warnings.warn(
            f"implicit gradient: conjugate gradients stopped after {iterations} iterations with relative "
            f"residual {float(residual.max()):.3g} > tol={tol}; {advice}",
            RuntimeWarning,
            stacklevel=4,
        )
    return w


class _AttractorRerouting(torch.autograd.Function):
    """Identity on ``g`` forward; backward: ``v`` to ``g`` and ``-w`` (spheres) or ``-M w`` (``x``) to ``dE/dg``,
    refusing samples that are not certified stable attractors."""

    @staticmethod
    def forward(
        ctx: Any,
        g: Tensor,
        grad_e: Tensor,
        field: ETField,
        x_star: Tensor,
        in_x: Tensor,
        certified: Tensor,
        tol: float,
        max_iter: int,
    ) -> Tensor:
        ctx.field, ctx.tol, ctx.max_iter = field, tol, max_iter
        ctx.save_for_backward(x_star, in_x, certified)
        return g.detach().clone()

    @staticmethod
    def backward(ctx: Any, v: Tensor) -> tuple[Tensor | None, ...]:
        x_star, in_x, certified = ctx.saved_tensors
        field = ctx.field
        asked = v.flatten(1).abs().amax(dim=1) > 0
        refused = torch.nonzero(asked & ~certified).flatten().tolist()
        if refused:
            raise AttractorError(
                f"no implicit gradient at sample(s) {refused}: not a certified stable attractor (a saddle, a "
                "degenerate point or a search that did not converge); see Attractor.kind and Attractor.converged"
            )
        w_out = torch.zeros_like(v)
        for geometry in (False, True):
            index = torch.nonzero(asked & (in_x == geometry)).flatten()
            if not len(index):
                continue
            bound = field.select(index)
            x, vi = x_star[index], v[index]
            neuron = field.model.neuron
            if geometry:
                apply, _, _ = euclidean_hessian(bound, x)
                rhs = neuron.hessian_vector(x, vi)
            else:
                g = neuron(x).detach()
                apply, _ = riemannian_hessian(bound, g)
                s, _ = radial_direction(g, sphere_neuron(neuron, "the implicit gradient on the spheres").delta.detach())
                rhs = tangent_projection(vi, s)
            # a right-hand side that is rounding noise (v normal to the manifold: w = 0) is not a system to solve
            noise = token_dot(rhs, rhs).sqrt() <= 1e-12 * token_dot(vi, vi).sqrt()
            rhs = torch.where(noise, torch.zeros_like(rhs), rhs)
            w = _solve_hessian_system(
                apply,
                rhs,
                tol=ctx.tol,
                max_iter=ctx.max_iter,
                advice="raise max_iter of the Implicit settings (solve's gradient=, "
                "find_attractor's implicit=, AttractorReadout's implicit=)",
            )
            # The solution is taken back into the operator's domain (tangent, or projected): the directions the
            # operator annihilates are invisible to the residual, and in float32 conjugate gradients drift along them
            # (a step of huge alpha where p.Ap is rounding noise), which the parameter gradients would carry.
            if geometry:
                w_out[index] = neuron.hessian_vector(x, neuron.project(w))
            else:
                w_out[index] = tangent_projection(w, s)
        return v, -w_out.detach(), None, None, None, None, None, None


def implicit_attractor(
    field: ETField, x_star: Tensor, *, in_x: Tensor, certified: Tensor, tol: float = 1e-10, max_iter: int = 500
) -> Tensor:
    """``g* = neuron(x*)`` whose parameter gradients come from the implicit function theorem at an attractor.

    On the spheres (``in_x`` False) the condition is ``T dE/dg(g*) = 0`` and the adjoint system
    ``Hess_R w = T v``; at a fixed point in ``x`` (``in_x`` True) it is ``M dE/dg = 0`` with ``Hess F w = M v``
    (``F = E(g(x))``, :func:`et_ode.dynamics.manifold.euclidean_hessian`), and ``dE/dg`` receives ``-M w``.
    Either way ``dL/dtheta = v . dg/dtheta - w' . d/dtheta[dE/dg(g(x*; theta); theta)]``.

    Args:
        field: the field (its mask, ``None``, ``(N, N)`` or ``(B, N, N)``, is used).
        x_star: the attractors ``(B, N, D)``.
        in_x, certified: per sample ``(B,)``: which geometry, and whether the point may be differentiated
            (a gradient asked of any other sample raises :class:`AttractorError`).
        tol, max_iter: the conjugate-gradient solve.

    Returns ``g*`` ``(B, N, D)``.
    """
    x_star = x_star.detach()
    g = field.model.neuron(x_star)
    if not torch.is_grad_enabled():
        return g
    grad_e = field.dE_dg(g)
    return _AttractorRerouting.apply(g, grad_e, field, x_star, in_x, certified, tol, max_iter)
