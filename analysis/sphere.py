"""The product of spheres at unit scale: where the critical points live, in coordinates that do not drift.

Every token of a state ``x`` with zero mean and ``sigma_A = sqrt(mean(x_A^2) + eps) = 1`` has
``g_A = gamma x_A + delta`` exactly, on the sphere of radius ``r = gamma sqrt(D (1 - eps))`` around
``delta`` in the centered subspace. The tangential eigenvalue of the metric ``M_A`` is then ``gamma`` for
every token, so the linearised g-dynamics at a critical point is exactly ``-(gamma / tau) Hess_R``.

:class:`FixedScaleField` is the ET field with the part of ``dx/dt`` that only moves ``x`` along its zero
modes (each token's mean and its radial scale) removed: ``g`` moves exactly as under the ET field (up to
the radial eigenvalue ``gamma eps / sigma^3`` of ``M``), but ``sigma`` stays 1, so the flow runs in the
intrinsic time of the dynamics instead of slowing down like ``1/t``. It is the limit of restarting the
flow at ``sigma = 1`` infinitely often, without the bias of finitely many restarts.

Shapes: ``(..., N, D)`` throughout; a tangent basis at one state ``(N, D)`` is ``(n, N, D)`` with
``n = N (D - 2)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from et_ode import ETField
from et_ode.dynamics.manifold import radial_direction, riemannian_hessian, tangent_projection


def unit_scale(x: Tensor, eps: float) -> Tensor:
    """Center every token and scale it to ``sigma = 1`` exactly (``mean(x_A^2) = 1 - eps``): ``(..., N, D)``."""
    centered = x - x.mean(dim=-1, keepdim=True)
    norm2 = centered.square().mean(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return centered * ((1.0 - eps) / norm2).sqrt()


def retract(x: Tensor, step: Tensor, eps: float) -> Tensor:
    """Move the unit-scale state ``x`` by ``step`` (units of ``x``) and put every token back at unit scale."""
    return unit_scale(x + step, eps)


class FixedScaleField(nn.Module):
    """``dx/dt = P_x f(t, x)``: the ET field ``f`` with each token's mean and radial component removed.

    ``P_x`` is the tangent projection at ``x``; the radial and all-ones parts of ``f`` are exactly the
    directions the metric ``M`` annihilates (up to O(eps)), so ``g`` follows the ET dynamics while ``|x_A|``
    stays constant. Start it from :func:`unit_scale` states. A plain ``nn.Module`` ``f(t, x)`` for torchdiffeq.
    """

    def __init__(self, field: ETField):
        super().__init__()
        if not isinstance(field, ETField):
            raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
        self.field = field

    def forward(self, t: Tensor, x: Tensor) -> Tensor:
        return tangent_projection(self.field(t, x), radial_direction(x, 0.0)[0])


def tangent_basis(g: Tensor, delta: Tensor | float) -> Tensor:
    """An orthonormal basis of the tangent space at ``g`` (``(B, N, D)``): ``(B, N (D-2), N, D)``.

    Vector ``A (D-2) + j`` lives on token ``A`` only, orthogonal to the all-ones vector and to the radial ``s_A``
    of ``g_A - delta``.
    """
    batch, n, d = g.shape
    s, _ = radial_direction(g, delta)
    ones = torch.full((batch, n, d), d**-0.5, dtype=g.dtype, device=g.device)
    frame = torch.stack([ones, s], dim=-1)  # (B, N, D, 2), orthonormal columns
    projector = torch.eye(d, dtype=g.dtype, device=g.device) - frame @ frame.transpose(-1, -2)
    _, vectors = torch.linalg.eigh(projector)  # eigenvalues 0, 0, 1, ..., 1
    tangent = vectors[..., 2:]  # (B, N, D, D-2)
    basis = torch.zeros(batch, n, d - 2, n, d, dtype=g.dtype, device=g.device)
    index = torch.arange(n, device=g.device)
    basis[:, index, :, index, :] = tangent.permute(1, 0, 3, 2)  # (N, B, D-2, D)
    return basis.reshape(batch, n * (d - 2), n, d)


def tangent_frame(x: Tensor) -> Tensor:
    """An orthonormal basis of the tangent space at the unit-scale state ``x`` ``(N, D)``: ``(N (D - 2), N, D)``
    (:func:`tangent_basis` of the centered ``x`` itself: vector ``A (D - 2) + j`` on token ``A`` only, orthogonal
    to the all-ones vector and to ``x_A``)."""
    return tangent_basis(x[None], 0.0)[0]


def hessian_in_frame(field: ETField, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The Riemannian Hessian of ``E`` at the unit-scale state ``x`` ``(N, D)`` in :func:`tangent_frame`.

    Returns ``(hessian (n, n), gradient (n,), frame (n, N, D))``: the symmetric matrix from ``n``
    Hessian-vector products of :func:`et_ode.dynamics.manifold.riemannian_hessian` (batched: ``n`` copies of the state,
    one backward pass), and the Riemannian gradient in the same coordinates (both with respect to ``g``).
    The field's mask must be ``None``, ``(N, N)`` or broadcastable to the ``n`` copies.
    """
    frame = tangent_frame(x)
    g = field.model.neuron(x).detach().expand(len(frame), *x.shape)  # one copy per frame vector: one backward pass
    apply, gradient = riemannian_hessian(field, g)
    images = apply(frame)  # (n, N, D): row i is Hess_R applied to frame vector i
    matrix = frame.flatten(1) @ images.flatten(1).T
    return (matrix + matrix.T) / 2, frame.flatten(1) @ gradient[0].flatten(), frame
