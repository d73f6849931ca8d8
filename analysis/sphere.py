"""The product of spheres the flow ends on, in coordinates that do not drift.

The analysis places its points where the flow's limit is (:func:`et_ode.dynamics.manifold.to_limit_spheres`, the
same placement :func:`et_ode.find_attractor` uses): every token centred at the scale ``S`` where ``eps / S^2`` is
below rounding, so ``g_A - delta`` lies on the sphere of radius ``r = gamma sqrt(D)`` in the centred subspace. A
tangent step of ``g`` moves there by :func:`et_ode.dynamics.manifold.retract`.

:class:`FixedScaleField` is the ET field with the part of ``dx/dt`` that only moves ``x`` along its zero modes
(each token's mean and its radial scale) removed, and each token's velocity multiplied by its scale ``sigma_A``:
``g`` moves as under the ET field in the time change ``ds = dt / sigma`` (up to the radial eigenvalue
``gamma eps / sigma^3`` of ``M``), while ``sigma`` stays fixed, so the flow runs in the intrinsic time of the
dynamics instead of slowing down like ``1/t``: the linearised ``g``-dynamics at a critical point is
``-(gamma / tau) Hess_R`` at any scale. It is the limit of restarting the flow infinitely often.

Shapes: ``(..., N, D)`` throughout; a tangent basis at one state ``(N, D)`` is ``(n, N, D)`` with
``n = N (D - 2)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from et_ode import ETField
from et_ode.dynamics.manifold import radial_direction, riemannian_hessian, tangent_projection
from et_ode.energy.neurons import sphere_neuron


class FixedScaleField(nn.Module):
    """``dx_A/dt = sigma_A P_x f(t, x)_A``: the ET field ``f`` with each token's mean and radial component removed,
    in each token's intrinsic time.

    ``P_x`` is the tangent projection at ``x``; the radial and all-ones parts of ``f`` are exactly the directions
    the metric ``M`` annihilates (up to O(eps)), so ``g`` moves as under the ET dynamics while ``|x_A|`` stays
    constant, and the factor ``sigma_A = sqrt(mean(xt_A^2) + eps)`` makes the tangential rate of ``g``
    ``gamma / tau`` at every token, whatever the scale (e.g. at the limit scale of
    :func:`~et_ode.dynamics.manifold.to_limit_spheres`). A plain ``nn.Module`` ``f(t, x)`` for torchdiffeq.

    Args:
        field: the ET field, with a LayerNorm neuron.

    Raises:
        TypeError: ``field`` is not an :class:`et_ode.ETField`.
        ValueError: a neuron other than LayerNorm (a Euclidean neuron's flow needs no fixing: its rates do not
            decay).
    """

    def __init__(self, field: ETField):
        super().__init__()
        if not isinstance(field, ETField):
            raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
        self.eps = sphere_neuron(field.model.neuron, "FixedScaleField").eps
        self.field = field

    def forward(self, t: Tensor, x: Tensor) -> Tensor:
        """The fixed-scale velocity ``dx/dt``.

        Args:
            t: the time (the field does not depend on it).
            x: states ``(..., N, D)``.

        Returns:
            ``dx/dt`` ``(..., N, D)``, tangent to each token's sphere.
        """
        xt = x - x.mean(dim=-1, keepdim=True)
        sigma = xt.square().mean(dim=-1, keepdim=True).add(self.eps).sqrt()
        return sigma * tangent_projection(self.field(t, x), radial_direction(x, 0.0)[0])


def tangent_basis(g: Tensor, delta: Tensor | float) -> Tensor:
    """An orthonormal basis of the tangent space at ``g``. Vector ``A (D-2) + j`` lives on token ``A`` only,
    orthogonal to the all-ones vector and to the radial ``s_A`` of ``g_A - delta``.

    Args:
        g: activations ``(B, N, D)``.
        delta: the LayerNorm shift, ``(D,)`` or a scalar.

    Returns:
        The basis, ``(B, N (D-2), N, D)``.
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
    """An orthonormal basis of the tangent space at the state ``x`` ``(N, D)``: ``(N (D - 2), N, D)``
    (:func:`tangent_basis` of the centered ``x`` itself: vector ``A (D - 2) + j`` on token ``A`` only, orthogonal
    to the all-ones vector and to ``x_A``)."""
    return tangent_basis(x[None], 0.0)[0]


def hessian_in_frame(field: ETField, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The Riemannian Hessian of ``E`` at ``g = LayerNorm(x)`` for the state ``x`` ``(N, D)`` in
    :func:`tangent_frame` (on the flow's limit spheres when ``x`` is placed there by
    :func:`~et_ode.dynamics.manifold.to_limit_spheres`).

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
