"""Where the analysis works: the chart of the set the critical points lie on, chosen by the model's neuron.

Every tool of :mod:`et_ode.analysis` that moves a state, measures a distance, forms a Hessian or integrates in
intrinsic time does it through a :class:`Chart` (:func:`chart_for`):

- :class:`SphereChart`, for the LayerNorm neuron (geometry ``"spheres"``): states on the flow's limit spheres
  (:func:`~et_ode.dynamics.manifold.to_limit_spheres`), coordinates ``g`` on the product of per-token spheres,
  tangent vectors of dimension ``N (D - 2)``, the Riemannian Hessian, and the fixed-scale flow
  (:class:`~et_ode.analysis.sphere.FixedScaleField`) for intrinsic time.
- :class:`EuclideanChart`, for a neuron of Euclidean geometry (:class:`~et_ode.IdentityNeuron` or one of the
  user's): states and coordinates ``x`` itself (the directions the neuron's ``project`` keeps, ``N D`` for the
  identity), the Hessian of ``F(x) = E(g(x))`` (:func:`et_ode.dynamics.manifold.euclidean_hessian`), and the plain
  flow, whose rates do not decay.

Coordinates are ``g`` on the spheres and ``x`` in the Euclidean chart (the same for the identity neuron).
Shapes: a batch of states ``(B, N, D)``, one state ``(N, D)``, a frame ``(n, N, D)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from et_ode import ETField, IdentityNeuron, LayerNormNeuron
from et_ode.analysis.sphere import FixedScaleField, hessian_in_frame, tangent_basis, tangent_frame
from et_ode.dynamics import manifold

Operator = Callable[[Tensor], Tensor]


class Chart:
    """The analysis's geometry for one field (see the module docstring); :func:`chart_for` picks the subclass.

    Args:
        field: the vector field.
    """

    name = ""
    unit = 1.0  # the coordinates' change per unit change of a canonical state (``gamma`` on the spheres)

    def __init__(self, field: ETField):
        self.field = field

    def canonical(self, x: Tensor) -> Tensor:
        """The representative state of ``x`` the analysis works at (same coordinates).

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The canonical states ``(..., N, D)``: on the limit spheres, or projected for a Euclidean neuron.
        """
        raise NotImplementedError

    def rescaled(self, x: Tensor) -> Tensor:
        """``x`` ``(B, N, D)`` with the flow's slowing time change undone before it flows on (on the spheres each
        sample shrunk to token scales of at most 1, the path of ``g`` kept; ``x`` itself otherwise).

        Args:
            x: states ``(B, N, D)``.

        Returns:
            The rescaled states ``(B, N, D)``.
        """
        raise NotImplementedError

    def coordinates(self, x: Tensor) -> Tensor:
        """The chart's coordinates of the states ``x``: ``g`` on the spheres, ``x`` itself otherwise.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The coordinates ``(..., N, D)``.
        """
        raise NotImplementedError

    def state(self, coordinates: Tensor) -> Tensor:
        """The canonical state with the given coordinates (the inverse of :meth:`coordinates`).

        Args:
            coordinates: coordinates ``(..., N, D)`` on the chart's set.

        Returns:
            The canonical states ``(..., N, D)``.
        """
        raise NotImplementedError

    def retract(self, x: Tensor, step: Tensor) -> Tensor:
        """The canonical state after moving the coordinates of ``x`` by the tangent ``step`` (coordinate units).

        Args:
            x: states ``(..., N, D)``.
            step: tangent vectors at ``x`` ``(..., N, D)``.

        Returns:
            The canonical states ``(..., N, D)``.
        """
        raise NotImplementedError

    def move(self, coordinates: Tensor, offset: Tensor) -> Tensor:
        """``coordinates + offset`` put back on the chart's set (each token back on its sphere, of the same radius).

        Args:
            coordinates: coordinates ``(..., N, D)`` on the chart's set.
            offset: the offsets ``(..., N, D)``.

        Returns:
            The moved coordinates ``(..., N, D)``.
        """
        raise NotImplementedError

    def energy(self, coordinates: Tensor) -> Tensor:
        """``E`` per sample at the given coordinates, with the field's mask.

        Args:
            coordinates: coordinates ``(..., N, D)``.

        Returns:
            The energies ``(...)``.
        """
        raise NotImplementedError

    def displacement(self, x: Tensor, w: Tensor) -> Tensor:
        """The change of state that moves the coordinates of ``x`` by the tangent ``w``, to first order.

        Args:
            x: states ``(..., N, D)``.
            w: tangent vectors of the coordinates at ``x`` ``(..., N, D)``.

        Returns:
            The change of state ``(..., N, D)``.
        """
        raise NotImplementedError

    def projector(self, x: Tensor) -> Operator:
        """``v -> v`` projected on the tangent space at the states ``x`` (``v`` shaped like ``x``).

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The projection, a function of ``v`` ``(..., N, D)``.
        """
        raise NotImplementedError

    def frame(self, x: Tensor) -> Tensor:
        """An orthonormal basis of the tangent space at one state.

        Args:
            x: one state ``(N, D)``.

        Returns:
            The basis ``(n, N, D)``, ``n = dimension(N)``.
        """
        raise NotImplementedError

    def basis(self, x: Tensor) -> Tensor:
        """An orthonormal tangent basis at every state of ``x``.

        Args:
            x: states ``(B, N, D)``.

        Returns:
            The bases ``(B, n, N, D)``.
        """
        raise NotImplementedError

    def dimension(self, tokens: int) -> int:
        """The tangent dimension ``n`` of a state of ``tokens`` tokens.

        Args:
            tokens: the number of tokens ``N``.

        Returns:
            ``n``: ``N (D - 2)`` on the spheres, ``N`` times the neuron's free dimension otherwise.
        """
        raise NotImplementedError

    def gradient(self, x: Tensor) -> Tensor:
        """The gradient of ``E`` on the chart at the states ``x`` (coordinates): ``T dE/dg`` on the spheres,
        ``dE(g(x))/dx = M dE/dg`` in the Euclidean chart.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The gradient ``(..., N, D)``, a tangent vector.
        """
        raise NotImplementedError

    def hessian(self, x: Tensor) -> tuple[Operator, Tensor]:
        """The Hessian at the states ``x`` ``(B, N, D)`` as an operator on tangent vectors, and the gradient there
        (both in coordinates).

        Args:
            x: states ``(B, N, D)``.

        Returns:
            The operator on tangent vectors ``(B, N, D)`` and the gradient ``(B, N, D)``.
        """
        raise NotImplementedError

    def hessian_in_frame(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(hessian (n, n), gradient (n,), frame (n, N, D))`` at one state ``x`` ``(N, D)``, from ``n``
        Hessian-vector products (one batched backward pass).

        Args:
            x: one state ``(N, D)``.

        Returns:
            The symmetric Hessian ``(n, n)``, the gradient ``(n,)`` and the frame ``(n, N, D)`` they are in.
        """
        raise NotImplementedError

    def rate_root(self, x: Tensor) -> Operator:
        """``w -> R w`` at the states ``x`` such that at a critical point the flow's Jacobian in coordinates has the
        spectrum of the symmetric ``-(1/tau) R Hess R`` (``Hess`` as :meth:`hessian`).

        Args:
            x: states ``(B, N, D)``.

        Returns:
            ``R``, a function of tangent vectors ``w`` ``(B, N, D)``.
        """
        raise NotImplementedError

    def velocity(self, field: ETField, x: Tensor) -> Tensor:
        """The coordinates' rate of change under ``field`` at ``x``: ``dg/dt`` on the spheres, ``dx/dt`` otherwise.

        Args:
            field: the vector field (this chart's, or one of the same neuron).
            x: states ``(..., N, D)``.

        Returns:
            The rate of change ``(..., N, D)``.
        """
        raise NotImplementedError

    def rate(self) -> float | None:
        """The one rate of every direction at canonical states (``gamma`` on the spheres, 1 for the identity neuron),
        or None where the rates differ (the linearised flow is then not ``-(rate / tau) Hess``)."""
        raise NotImplementedError

    def steady_field(self) -> nn.Module:
        """The flow in intrinsic time: ``f(t, x)`` whose rates do not decay along the way."""
        raise NotImplementedError


class SphereChart(Chart):
    """The LayerNorm neuron's product of spheres, its points on the flow's limit spheres of radius ``gamma sqrt(D)``."""

    name = "spheres"

    def __init__(self, field: ETField, neuron: LayerNormNeuron):
        super().__init__(field)
        self.neuron = neuron
        self.gamma = neuron.gamma.detach()
        self.delta = neuron.delta.detach()
        self.eps = neuron.eps
        self.unit = float(self.gamma)

    def canonical(self, x: Tensor) -> Tensor:
        return manifold.to_limit_spheres(x, self.eps)

    def rescaled(self, x: Tensor) -> Tensor:
        return manifold.shrink_scale(x)

    def coordinates(self, x: Tensor) -> Tensor:
        return self.neuron(x)

    def state(self, coordinates: Tensor) -> Tensor:
        return manifold.to_limit_spheres(coordinates - self.delta, self.eps)

    def retract(self, x: Tensor, step: Tensor) -> Tensor:
        return manifold.retract(x, step, self.gamma, self.eps)

    def move(self, coordinates: Tensor, offset: Tensor) -> Tensor:
        u0 = coordinates - self.delta
        radius = u0.norm(dim=-1, keepdim=True)
        u = u0 + offset
        u = u - u.mean(dim=-1, keepdim=True)
        return self.delta + radius * u / u.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(u.dtype).tiny)

    def energy(self, coordinates: Tensor) -> Tensor:
        return self.field.energy_g(coordinates)

    def _sigma(self, x: Tensor) -> Tensor:
        return (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1, keepdim=True).add(self.eps).sqrt()

    def displacement(self, x: Tensor, w: Tensor) -> Tensor:
        return w * self._sigma(x) / self.gamma

    def projector(self, x: Tensor) -> Operator:
        with torch.no_grad():
            s, _ = manifold.radial_direction(self.neuron(x), self.delta)
        return lambda v: manifold.tangent_projection(v, s)

    def frame(self, x: Tensor) -> Tensor:
        return tangent_frame(x)

    def basis(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return tangent_basis(self.neuron(x), self.delta)

    def dimension(self, tokens: int) -> int:
        return tokens * (self.neuron.dim - 2)

    def gradient(self, x: Tensor) -> Tensor:
        return self.field.tangent_gradient(x)

    def hessian(self, x: Tensor) -> tuple[Operator, Tensor]:
        return manifold.riemannian_hessian(self.field, self.neuron(x).detach())

    def hessian_in_frame(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return hessian_in_frame(self.field, x)

    def rate_root(self, x: Tensor) -> Operator:
        root = (self.gamma / self._sigma(x)).sqrt()
        return lambda w: root * w

    def velocity(self, field: ETField, x: Tensor) -> Tensor:
        return field.dg_dt(x, field.velocity(x))

    def rate(self) -> float | None:
        return float(self.gamma)

    def steady_field(self) -> nn.Module:
        return FixedScaleField(self.field)


class EuclideanChart(Chart):
    """A neuron of Euclidean geometry: states and coordinates ``x``, on the directions its ``project`` keeps."""

    name = "euclidean"

    def __init__(self, field: ETField):
        super().__init__(field)
        self.neuron = field.model.neuron

    def canonical(self, x: Tensor) -> Tensor:
        return self.neuron.project(x)

    def rescaled(self, x: Tensor) -> Tensor:
        return x

    def coordinates(self, x: Tensor) -> Tensor:
        return x

    def state(self, coordinates: Tensor) -> Tensor:
        return self.neuron.project(coordinates)

    def retract(self, x: Tensor, step: Tensor) -> Tensor:
        return x + self.neuron.project(step)

    def move(self, coordinates: Tensor, offset: Tensor) -> Tensor:
        return coordinates + self.neuron.project(offset)

    def energy(self, coordinates: Tensor) -> Tensor:
        return self.field.energy(coordinates)

    def displacement(self, x: Tensor, w: Tensor) -> Tensor:
        return w

    def projector(self, x: Tensor) -> Operator:
        return self.neuron.project

    def frame(self, x: Tensor) -> Tensor:
        n, d = x.shape
        eye = torch.eye(d, dtype=x.dtype, device=x.device)
        values, vectors = torch.linalg.eigh(self.neuron.project(eye[None])[0])
        kept = vectors[:, values > 0.5].T  # (free, D): the orthonormal range of the projection
        basis = torch.zeros(n, len(kept), n, d, dtype=x.dtype, device=x.device)
        index = torch.arange(n, device=x.device)
        basis[index, :, index, :] = kept
        return basis.reshape(n * len(kept), n, d)

    def basis(self, x: Tensor) -> Tensor:
        return torch.stack([self.frame(state) for state in x])

    def dimension(self, tokens: int) -> int:
        return tokens * self.neuron.free_dimension()

    def gradient(self, x: Tensor) -> Tensor:
        return self.neuron.project(self.neuron.hessian_vector(x, self.field.dE_dg(self.neuron(x))))

    def hessian(self, x: Tensor) -> tuple[Operator, Tensor]:
        apply, gradient, _ = manifold.euclidean_hessian(self.field, x)
        return apply, gradient

    def hessian_in_frame(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        frame = self.frame(x)
        apply, gradient, _ = manifold.euclidean_hessian(self.field, x.detach().expand(len(frame), *x.shape))
        images = apply(frame)
        matrix = frame.flatten(1) @ images.flatten(1).T
        return (matrix + matrix.T) / 2, frame.flatten(1) @ gradient[0].flatten(), frame

    def rate_root(self, x: Tensor) -> Operator:
        if isinstance(self.neuron, IdentityNeuron):
            return lambda w: w
        with torch.no_grad():
            values, vectors = torch.linalg.eigh(self.neuron.metric(x))  # (B, N, D), (B, N, D, D)
        inverse_root = torch.where(values > 1e-12 * values.amax(dim=-1, keepdim=True), values, torch.inf).rsqrt()
        matrix = vectors @ (inverse_root[..., None] * vectors.transpose(-1, -2))  # M^(-1/2) on the range of M

        def apply(w: Tensor) -> Tensor:  # with Hess F = M H M at a fixed point: M^(-1/2) Hess F M^(-1/2) = M^(1/2) H M^(1/2)
            return (matrix @ w[..., None])[..., 0]

        return apply

    def velocity(self, field: ETField, x: Tensor) -> Tensor:
        return field.velocity(x)

    def rate(self) -> float | None:
        return 1.0 if isinstance(self.neuron, IdentityNeuron) else None

    def steady_field(self) -> nn.Module:
        return self.field


def chart_for(field: ETField) -> Chart:
    """The chart of ``field``'s neuron: :class:`SphereChart` for the LayerNorm neuron, :class:`EuclideanChart` for
    a neuron of Euclidean geometry.

    Args:
        field: the vector field.

    Returns:
        The :class:`Chart`.

    Raises:
        TypeError: ``field`` is not an :class:`et_ode.ETField`.
    """
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    neuron = field.model.neuron
    return SphereChart(field, neuron) if isinstance(neuron, LayerNormNeuron) else EuclideanChart(field)
