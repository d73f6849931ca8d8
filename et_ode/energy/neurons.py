"""Neurons: the LayerNorm Lagrangian whose gradient is the ET's activation, and the geometry of its image.

Shapes: ``x`` is ``(..., N, D)``: any leading (batch) dimensions, ``N`` tokens of ``D`` elements.
Everything acts per token, so the cost is O(N D).

Every normalized token ``g_A - delta`` has zero mean and lies (up to O(eps)) on a sphere in the centered
subspace; :func:`radial_direction` and :func:`tangent_projection` are that sphere's geometry, the one
definition used by the field, :mod:`et_ode.dynamics.manifold` and the analysis.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from et_ode.backend.validation import check_positive


def radial_direction(g: Tensor, delta: Tensor | float) -> tuple[Tensor, Tensor]:
    """Unit radial direction ``s_A = (g_A - delta) / r_A`` (centered) and the radius ``r_A``: ``(..., N, D)`` ->
    ``((..., N, D), (..., N, 1))``. ``delta = 0`` gives the direction of a centered state ``x`` itself."""
    u = g - delta
    u = u - u.mean(dim=-1, keepdim=True)
    radius = u.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
    return u / radius, radius


def tangent_projection(v: Tensor, s: Tensor) -> Tensor:
    """``T v``: ``v`` with each token's mean and its component along the unit radial ``s`` removed: ``(..., N, D)``."""
    v = v - v.mean(dim=-1, keepdim=True)
    return v - (v * s).sum(dim=-1, keepdim=True) * s


def inverse_softplus(y: float) -> float:
    """The ``r`` with ``softplus(r) == y`` for ``y > 0``."""
    return y + math.log(-math.expm1(-y))


class LayerNormNeuron(nn.Module):
    """The LayerNorm Lagrangian ``L(x_A) = D gamma sigma_A + delta . x_A``.

    Its gradient is the layer-normalized token ``g = dL/dx`` and its Hessian ``M_A = dg_A/dx_A``
    is positive semi-definite exactly when ``gamma >= 0``: that is what makes the energy a
    Lyapunov function. ``gamma`` is therefore stored as ``softplus(gamma_raw)``, positive for
    every value of the trainable raw parameter.

    Args:
        dim: token size ``D``.
        gamma: initial value of the scale, > 0.
        eps: the regularizer under the square root, > 0.
        positive_gamma: keep ``gamma`` positive by construction (the default). ``False`` stores
            ``gamma`` as a free parameter that may take any sign; this exists to study what goes
            wrong without the guarantee (the Lyapunov checks flag it), not for training.
        dtype, device: of the parameters (PyTorch's factory arguments). ``gamma_raw`` is created in ``dtype``
            directly, so a model built in float64 holds ``softplus^-1(gamma)`` to float64 precision; ``eps`` is a
            Python float, exact in every dtype.
    """

    def __init__(
        self,
        dim: int,
        *,
        gamma: float = 1.0,
        eps: float = 1e-5,
        positive_gamma: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
        check_positive("eps", eps)
        if positive_gamma:
            check_positive("gamma", gamma)
        self.dim = dim
        self.eps = float(eps)
        self.positive_gamma = positive_gamma
        raw = inverse_softplus(gamma) if positive_gamma else gamma
        self.gamma_raw = nn.Parameter(torch.tensor(float(raw), dtype=dtype, device=device))
        self.delta = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    @property
    def gamma(self) -> Tensor:
        """The scale ``gamma`` (a 0-d tensor, differentiable)."""
        return F.softplus(self.gamma_raw) if self.positive_gamma else self.gamma_raw

    def _centered(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``xt = x - mean(x)`` and ``sigma = sqrt(mean(xt^2) + eps)``, shapes ``(..., N, D)``, ``(..., N, 1)``."""
        xt = x - x.mean(dim=-1, keepdim=True)
        sigma = torch.sqrt(xt.square().mean(dim=-1, keepdim=True) + self.eps)
        return xt, sigma

    def lagrangian(self, x: Tensor) -> Tensor:
        """``L(x_A)`` per token: ``(..., N, D) -> (..., N)``."""
        _, sigma = self._centered(x)
        return self.dim * self.gamma * sigma.squeeze(-1) + x @ self.delta

    def forward(self, x: Tensor) -> Tensor:
        """The activation ``g = dL/dx``: ``(..., N, D) -> (..., N, D)``."""
        xt, sigma = self._centered(x)
        return self.gamma * xt / sigma + self.delta

    def hessian_vector(self, x: Tensor, v: Tensor) -> Tensor:
        """``M_A v_A`` for every token, in closed form (no autograd): ``(..., N, D) -> (..., N, D)``.

        ``M_A = (gamma / sigma_A) (I - 11^T / D - xt xt^T / (D sigma_A^2))``.
        """
        xt, sigma = self._centered(x)
        v_centered = v - v.mean(dim=-1, keepdim=True)
        along = (xt * v).sum(dim=-1, keepdim=True) / (self.dim * sigma.square())
        return (self.gamma / sigma) * (v_centered - along * xt)
