"""Neurons: a Lagrangian per token whose gradient is the activation ``g`` and whose Hessian is the flow's metric.

A :class:`Neuron` is the public interface: a Lagrangian ``L(x_A)`` of each token, its gradient ``g = dL/dx`` (the
activation the energies read) and its Hessian ``M_A = dg_A/dx_A`` as Hessian-vector products (the metric of the flow
``tau dx/dt = -dE/dg``, which lowers ``E`` at the rate ``dE/dt = -(1/tau) sum_A dE/dg_A . M_A dE/dg_A``: the energy
is a Lyapunov function wherever every ``M_A`` is positive semi-definite, i.e. ``L`` is convex). A subclass writes
:meth:`Neuron.lagrangian`; ``torch.func`` supplies the rest, and closed forms may replace it. Two neurons ship:
:class:`LayerNormNeuron` (the ET's) and :class:`IdentityNeuron` (``g = x``, a plain gradient flow).

A neuron declares its ``geometry``, where the flow's attractors lie: ``"euclidean"`` (fixed points in ``x``, the
default) or ``"spheres"``, the LayerNorm neuron's: every normalized token ``g_A - delta`` has zero mean and lies (up
to O(eps)) on a sphere in the centered subspace, towards which the flow drives the tokens' scales.
:func:`radial_direction` and :func:`tangent_projection` are that sphere's geometry, the one definition used by the
field, :mod:`et_ode.dynamics.manifold` and the analysis; :func:`sphere_neuron` is how a tool that needs it asks.

Shapes: ``x`` is ``(..., N, D)``: any leading (batch) dimensions, ``N`` tokens of ``D`` elements.
Everything acts per token, so the cost is O(N D).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from et_ode.backend.validation import check_positive

GEOMETRIES = ("euclidean", "spheres")


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


class Neuron(nn.Module):
    """A neuron: the Lagrangian ``L(x_A)`` of every token, its gradient ``g = dL/dx`` and its Hessian ``M = dg/dx``.

    A subclass defines :meth:`lagrangian` (and, for a closed form, :meth:`forward` and :meth:`hessian_vector`, which
    default to ``torch.func`` derivatives of it). ``L`` convex (every ``M_A`` positive semi-definite) makes the energy
    a Lyapunov function of the flow. ``geometry`` says where the attractors lie: ``"euclidean"`` (the default: fixed
    points in ``x``, where ``M dE/dg = 0``) or ``"spheres"`` (declared by :class:`LayerNormNeuron` alone).

    Args:
        dim: token size ``D``, a positive integer.

    Raises:
        ValueError: ``dim`` is not a positive integer.
    """

    geometry: ClassVar[str] = "euclidean"

    def __init__(self, dim: int):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        self.dim = dim

    def lagrangian(self, x: Tensor) -> Tensor:
        """``L(x_A)`` per token.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``L``, ``(..., N)``.
        """
        raise NotImplementedError(f"{type(self).__name__} must define lagrangian(x)")

    def forward(self, x: Tensor) -> Tensor:
        """The activation ``g = dL/dx`` (``torch.func.grad`` of :meth:`lagrangian`).

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``g``, ``(..., N, D)``.
        """
        return torch.func.grad(lambda state: self.lagrangian(state).sum())(x)

    def hessian_vector(self, x: Tensor, v: Tensor) -> Tensor:
        """``M_A v_A`` for every token (a ``torch.func.jvp`` of :meth:`forward`).

        Args:
            x: states ``(..., N, D)``.
            v: vectors ``(..., N, D)``.

        Returns:
            ``M v``, ``(..., N, D)``.
        """
        return torch.func.jvp(self.forward, (x,), (v,))[1]

    def project(self, v: Tensor) -> Tensor:
        """``v`` without the directions every ``M_A`` annihilates whatever ``x`` (``g`` does not move along them).
        None by default; the LayerNorm neuron removes each token's mean.

        Args:
            v: vectors ``(..., N, D)``.

        Returns:
            The projected ``v``, ``(..., N, D)``.
        """
        return v

    def metric(self, x: Tensor) -> Tensor:
        """Every token's ``M_A`` as a dense matrix (``D`` Hessian-vector products).

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``M``, ``(..., N, D, D)``.
        """
        basis = torch.eye(self.dim, dtype=x.dtype, device=x.device)
        columns = [self.hessian_vector(x, basis[j].expand_as(x)) for j in range(self.dim)]
        return torch.stack(columns, dim=-1)

    def free_dimension(self) -> int:
        """The dimension per token that :meth:`project` keeps (``D`` by default, ``D - 1`` for LayerNorm)."""
        eye = torch.eye(self.dim, dtype=torch.float64)
        return round(float(self.project(eye[None]).diagonal(dim1=-2, dim2=-1).sum()))

    def conditioning(self, x: Tensor) -> Tensor:
        """How unequal the flow's rates are at ``x``: the largest eigenvalue of any token's ``M_A`` over the smallest,
        on the directions :meth:`project` keeps, per sample.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The ratio per sample, ``(...)``.
        """
        with torch.no_grad():
            values = torch.linalg.eigvalsh(self.metric(x))[..., self.dim - self.free_dimension() :]
        tiny = torch.finfo(x.dtype).tiny
        return values.amax(dim=(-1, -2)) / values.amin(dim=(-1, -2)).clamp_min(tiny)


class IdentityNeuron(Neuron):
    """``L(x_A) = |x_A|^2 / 2``: ``g = x`` and ``M = I``, so the flow ``tau dx/dt = -dE/dx`` is the plain gradient
    flow of the energy, with Euclidean geometry (its attractors are the minima of ``E``).

    Args:
        dim: token size ``D``, a positive integer.
    """

    def lagrangian(self, x: Tensor) -> Tensor:
        return 0.5 * x.square().sum(dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        return x.clone()

    def hessian_vector(self, x: Tensor, v: Tensor) -> Tensor:
        return v.clone()

    def conditioning(self, x: Tensor) -> Tensor:
        return torch.ones(x.shape[:-2], dtype=x.dtype, device=x.device)


class LayerNormNeuron(Neuron):
    """The LayerNorm Lagrangian ``L(x_A) = D gamma sigma_A + delta . x_A``.

    The ET's neuron, of geometry ``"spheres"``. Its gradient is the layer-normalized token ``g = dL/dx`` and its
    Hessian ``M_A = dg_A/dx_A`` is positive semi-definite exactly when ``gamma >= 0``: that is what makes the energy a
    Lyapunov function. ``gamma`` is therefore stored as ``softplus(gamma_raw)``, positive for every value of the
    trainable raw parameter.

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

    geometry: ClassVar[str] = "spheres"

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
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
        super().__init__(dim)
        check_positive("eps", eps)
        if positive_gamma:
            check_positive("gamma", gamma)
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
        """``L(x_A)`` per token; see :meth:`Neuron.lagrangian`.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``L``, ``(..., N)``.
        """
        _, sigma = self._centered(x)
        return self.dim * self.gamma * sigma.squeeze(-1) + x @ self.delta

    def forward(self, x: Tensor) -> Tensor:
        """The activation ``g = gamma xt / sigma + delta``; see :meth:`Neuron.forward`.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``g``, ``(..., N, D)``.
        """
        xt, sigma = self._centered(x)
        return self.gamma * xt / sigma + self.delta

    def hessian_vector(self, x: Tensor, v: Tensor) -> Tensor:
        """``M_A v_A`` for every token, in closed form (no autograd): ``(..., N, D) -> (..., N, D)``.

        ``M_A = (gamma / sigma_A) (I - 11^T / D - xt xt^T / (D sigma_A^2))``.

        Args:
            x: states ``(..., N, D)``.
            v: vectors ``(..., N, D)``.

        Returns:
            ``M v``, ``(..., N, D)``.
        """
        xt, sigma = self._centered(x)
        v_centered = v - v.mean(dim=-1, keepdim=True)
        along = (xt * v).sum(dim=-1, keepdim=True) / (self.dim * sigma.square())
        return (self.gamma / sigma) * (v_centered - along * xt)

    def project(self, v: Tensor) -> Tensor:
        """``v`` with each token's mean removed (the all-ones vector is the exact zero mode of every ``M_A``).

        Args:
            v: vectors ``(..., N, D)``.

        Returns:
            The projected ``v``, ``(..., N, D)``.
        """
        return v - v.mean(dim=-1, keepdim=True)

    def conditioning(self, x: Tensor) -> Tensor:
        """The spread of the tangential rates ``gamma / sigma_A`` over the tokens, per sample: ``max sigma / min
        sigma`` (the radial eigenvalue ``gamma eps / sigma^3`` vanishes as the tokens grow, and is left out).

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The ratio per sample, ``(...)``.
        """
        sigma = (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1).sqrt()
        return sigma.amax(dim=-1) / sigma.amin(dim=-1).clamp_min(torch.finfo(x.dtype).tiny)


def sphere_neuron(neuron: Neuron, tool: str) -> LayerNormNeuron:
    """``neuron`` itself where its geometry is ``"spheres"`` (a :class:`LayerNormNeuron`), for a ``tool`` that needs
    its sphere (``gamma``, ``delta``, the token scales).

    Raises:
        ValueError: naming the tool and the neuron, for any other neuron.
    """
    if not isinstance(neuron, LayerNormNeuron):
        raise ValueError(
            f"{tool} needs the LayerNorm neuron's sphere geometry (gamma, delta, token scales); the model's neuron "
            f"{type(neuron).__name__} has geometry {neuron.geometry!r}"
        )
    return neuron
