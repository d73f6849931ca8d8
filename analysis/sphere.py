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
from et_ode.manifold import radial_direction, riemannian_hessian, tangent_projection


def unit_scale(x: Tensor, eps: float) -> Tensor:
    """Center every token and scale it to ``sigma = 1`` exactly (``mean(x_A^2) = 1 - eps``): ``(..., N, D)``."""
    centered = x - x.mean(dim=-1, keepdim=True)
    norm2 = centered.square().mean(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return centered * ((1.0 - eps) / norm2).sqrt()


def retract(x: Tensor, step: Tensor, eps: float) -> Tensor:
    """Move the unit-scale state ``x`` by ``step`` (units of ``x``) and put every token back at unit scale."""
    return unit_scale(x + step, eps)


def token_frame(x: Tensor) -> Tensor:
    """Unit radial direction ``s_A`` of every token of a centered state: ``(..., N, D)``."""
    centered = x - x.mean(dim=-1, keepdim=True)
    return centered / centered.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


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
        return tangent_projection(self.field(t, x), token_frame(x))


def tangent_gradient_at(field: ETField, x: Tensor) -> Tensor:
    """The Riemannian gradient ``T dE/dg`` at ``g = LayerNorm(x)``: ``(..., N, D)``."""
    neuron = field.model.neuron
    with torch.no_grad():
        g = neuron(x)
        s, _ = radial_direction(g, neuron.delta.detach())
        return tangent_projection(field.dE_dg(g), s)


def energy_at(field: ETField, x: Tensor) -> Tensor:
    """``E(LayerNorm(x))`` per sample with the field's mask: ``(..., N, D) -> (...)``."""
    model = field.model
    with torch.no_grad():
        return model.energy_g(model.neuron(x), field.mask)


def tangent_frame(x: Tensor) -> Tensor:
    """An orthonormal basis of the tangent space at the unit-scale state ``x`` ``(N, D)``: ``(N (D - 2), N, D)``.

    Vector ``A (D - 2) + j`` lives on token ``A`` only, orthogonal to the all-ones vector and to ``x_A``.
    """
    n, d = x.shape
    s = token_frame(x)
    ones = torch.full((n, d), d ** -0.5, dtype=x.dtype, device=x.device)
    frame = torch.stack([ones, s], dim=-1)  # (N, D, 2), orthonormal columns
    projector = torch.eye(d, dtype=x.dtype, device=x.device) - frame @ frame.transpose(-1, -2)
    _, vectors = torch.linalg.eigh(projector)  # eigenvalues 0, 0, 1, ..., 1
    tangent = vectors[..., 2:].transpose(-1, -2)  # (N, D-2, D)
    basis = torch.zeros(n, d - 2, n, d, dtype=x.dtype, device=x.device)
    index = torch.arange(n, device=x.device)
    basis[index, :, index, :] = tangent
    return basis.reshape(n * (d - 2), n, d)


def hessian_in_frame(field: ETField, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The Riemannian Hessian of ``E`` at the unit-scale state ``x`` ``(N, D)`` in :func:`tangent_frame`.

    Returns ``(hessian (n, n), gradient (n,), frame (n, N, D))``: the symmetric matrix from ``n``
    Hessian-vector products of :func:`et_ode.manifold.riemannian_hessian` (batched: ``n`` copies of the state,
    one backward pass), and the Riemannian gradient in the same coordinates (both with respect to ``g``).
    The field's mask must be ``None``, ``(N, N)`` or broadcastable to the ``n`` copies.
    """
    frame = tangent_frame(x)
    g = field.model.neuron(x).detach().expand(len(frame), *x.shape)  # one copy per frame vector: one backward pass
    apply, gradient = riemannian_hessian(field, g)
    images = apply(frame)  # (n, N, D): row i is Hess_R applied to frame vector i
    matrix = frame.flatten(1) @ images.flatten(1).T
    return (matrix + matrix.T) / 2, frame.flatten(1) @ gradient[0].flatten(), frame
