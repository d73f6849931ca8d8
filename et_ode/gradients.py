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
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .field import ETField
from .manifold import radial_direction, riemannian_hessian, tangent_projection


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample inner product over tokens and elements: ``(..., N, D) -> (..., 1, 1)``."""
    return (a * b).sum(dim=(-1, -2), keepdim=True)


def conjugate_gradient(apply: Any, b: Tensor, *, tol: float, max_iter: int) -> tuple[Tensor, int, Tensor]:
    """Solve ``A w = b`` per sample for a symmetric positive definite ``A`` given as ``apply(w)``.

    Shapes: ``b`` is ``(..., N, D)``; every sample (leading index) is its own system.
    Returns the solution, the iterations used and the relative residual per sample ``(...)``.
    """
    w = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = _dot(r, r)
    b_norm = rr.sqrt().clamp_min(torch.finfo(b.dtype).tiny)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        if bool((rr.sqrt() <= tol * b_norm).all()):
            iterations -= 1
            break
        ap = apply(p)
        p_ap = _dot(p, ap)
        alpha = torch.where(p_ap != 0, rr / p_ap, torch.zeros_like(rr))
        w = w + alpha * p
        r = r - alpha * ap
        rr_new = _dot(r, r)
        p = r + torch.where(rr != 0, rr_new / rr, torch.zeros_like(rr)) * p
        rr = rr_new
    return w, iterations, (rr.sqrt() / b_norm).reshape(b.shape[:-2])


class _ImplicitRerouting(torch.autograd.Function):
    """Identity on ``g`` in the forward pass; in the backward pass sends ``v`` to ``g`` and ``-w`` to ``dE/dg``."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, grad_e: Tensor, field: ETField, g_star: Tensor, tol: float,
                max_iter: int) -> Tensor:
        ctx.field, ctx.tol, ctx.max_iter = field, tol, max_iter
        ctx.save_for_backward(g_star)
        return g.detach().clone()

    @staticmethod
    def backward(ctx: Any, v: Tensor) -> tuple[Tensor | None, ...]:
        (g_star,) = ctx.saved_tensors
        hessian, _ = riemannian_hessian(ctx.field, g_star)
        s, _ = radial_direction(g_star, ctx.field.model.neuron.delta.detach())
        w, iterations, residual = conjugate_gradient(hessian, tangent_projection(v, s), tol=ctx.tol,
                                                     max_iter=ctx.max_iter)
        if bool((residual > ctx.tol).any()):
            warnings.warn(
                f"implicit gradient: conjugate gradients stopped after {iterations} iterations with relative "
                f"residual {float(residual.max()):.3g} > tol={ctx.tol}; the fixed point may not be a stable "
                "attractor (Riemannian Hessian not positive definite) or needs more iterations (implicit_max_iter)",
                RuntimeWarning, stacklevel=2)
        return v, -w.detach(), None, None, None, None


def implicit_fixed_point(field: ETField, x_star: Tensor, *, tol: float = 1e-8, max_iter: int = 200) -> Tensor:
    """``g* = LayerNorm(x*)`` whose gradients come from the implicit function theorem.

    Args:
        field: the field whose fixed point ``x_star`` is (its mask is used).
        x_star: a converged state ``(*batch, N, D)`` (detached).
        tol, max_iter: relative residual and iteration cap of the conjugate-gradient solve.

    Returns ``g*`` of shape ``(*batch, N, D)``, differentiable with respect to the model's parameters.
    """
    g = field.model.neuron(x_star.detach())
    if not torch.is_grad_enabled():
        return g
    grad_e = field.grad_g(g)
    return _ImplicitRerouting.apply(g, grad_e, field, g.detach(), tol, max_iter)
