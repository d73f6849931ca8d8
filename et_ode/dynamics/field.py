"""The vector field ``tau dx/dt = -dE/dg`` of an energy model (the ET or any other): a plain ``nn.Module`` ``f(t, x)``
for any ODE solver."""

from __future__ import annotations

import copy
import numbers
import threading
from typing import Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from et_ode.backend.validation import check_positive
from et_ode.energy.checks import check_mask, check_tokens
from et_ode.energy.masks import GraphMask, Mask
from et_ode.energy.model import EnergyModel, EnergyTransformer
from et_ode.energy.neurons import LayerNormNeuron, radial_direction, tangent_projection
from et_ode.kernels.fused import FusedGrad

Derivative = Literal["analytic", "autograd"]
Backend = Literal["auto", "fused", "reference"]
DERIVATIVES: tuple[Derivative, ...] = get_args(Derivative)
BACKENDS: tuple[Backend, ...] = get_args(Backend)


class Evaluations:
    """How many times a field has been evaluated, per thread. Shared by copies of the field made by ``with_mask``.

    Each thread adds to a count of its own (only that thread writes it, so concurrent solves never lose or share an
    evaluation): :meth:`made` is the calling thread's running total (it never goes down, whatever ``reset_nfe``
    does), :meth:`made_by` another thread's, ``count`` the evaluations of all threads since the last reset.
    """

    def __init__(self) -> None:
        self._made: dict[int, int] = {}  # thread id -> evaluations that thread made
        self._reset_at = 0

    def add(self, evaluations: int = 1) -> None:
        """Count ``evaluations`` made by the calling thread."""
        thread = threading.get_ident()
        self._made[thread] = self._made.get(thread, 0) + evaluations

    def made(self) -> int:
        """Evaluations the calling thread has made since the field's construction (monotonic)."""
        return self._made.get(threading.get_ident(), 0)

    def made_by(self, thread: int) -> int:
        """Evaluations the thread ``thread`` (a ``threading.get_ident()``) has made since the field's construction."""
        return self._made.get(thread, 0)

    def _total(self) -> int:
        return sum(list(self._made.values()))

    @property
    def count(self) -> int:
        """Evaluations of all threads since the last reset."""
        return self._total() - self._reset_at

    @count.setter
    def count(self, value: int) -> None:
        self._reset_at = self._total() - value


class ETField(nn.Module):
    """``f(t, x) = -(1/tau) dE/dg(g(x))`` for a state ``x`` of shape ``(..., N, D)``: the one owner of the dynamics.

    Args:
        model: the energy: an :class:`~et_ode.EnergyModel` (a neuron and interaction energies), such as the
            :class:`~et_ode.EnergyTransformer`.
        tau: time constant, a positive finite real number (TypeError for another type, ValueError otherwise).
        derivative: how ``dE/dg`` is computed: ``"analytic"`` (closed form, the default) or ``"autograd"``
            (differentiates the energy; the reference, also correct under ``torch.no_grad()``).
        mask: the mask bound to the field, handed to every interaction (see :class:`~et_ode.EnergyModel`); a field
            holds its mask, and :meth:`with_mask` makes a copy bound to another.
        backend: how ``derivative="analytic"`` evaluates ``dE/dg``: ``"fused"`` (:mod:`et_ode.kernels.fused`, for an
            :class:`~et_ode.EnergyTransformer`: two large matrix products on the fastest GEMM back end, and a
            closed-form Hessian-vector product as its backward), ``"reference"`` (the interactions' own ``dE_dg``,
            differentiated by autograd), or ``"auto"`` (the default: fused wherever it applies). The fused path
            applies to masks that are ``None`` or dense boolean tensors; any other mask falls back to the model's
            closed form. Its backward is first-order (no double backward through the field).

    Everything downstream (``solve``, the attractor finder, ``et_ode.analysis``) reads the dynamics through the
    public methods below, never through the model's internals:

    ============================  ==============================================================
    ``forward(t, x)``             ``dx/dt``, counted in ``nfe`` (what solvers call)
    ``with_mask(mask)``           a copy bound to another mask; ``select(index)`` the field of some samples
    ``velocity(x)``               ``dx/dt = -(1/tau) dE/dg``, not counted
    ``activation(x)``             ``g = neuron(x)`` (``LayerNorm(x)`` for the ET)
    ``energy(x)``, ``energy_g(g)``  ``E`` per sample, with the bound mask
    ``dE_dg(g)``                  ``dE/dg`` by the chosen derivative and back end, not counted
    ``dg_dt(x)``                  ``M dx/dt``, the motion of ``g``
    ``tangent_gradient(x)``       ``dE/dg`` where the attractors lie: ``T dE/dg`` on the spheres
    ``rms_dg_dt``, ``rms_tangent_gradient``  their RMS per sample (the steady-state measures)
    ``dE_dt(x)``                  the exact energy rate ``-(1/tau) sum_A dE/dg_A . M_A dE/dg_A``
    ============================  ==============================================================

    The field counts its evaluations in ``nfe`` (``reset_nfe()`` zeroes it; ``count_evaluations(n)`` adds work
    done through :meth:`dE_dg`, such as Hessian-vector products). ``forward`` does not validate its input,
    since solvers call it thousands of times; ``solve`` validates once, and the diagnostics validate theirs
    unless they are handed the velocity already computed at ``x`` (the solver's hot path).

    Raises:
        TypeError: ``model`` is not an EnergyModel, or ``tau`` not a real number.
        ValueError: ``tau`` is not positive and finite, ``derivative`` or ``backend`` is unknown, or
            ``backend="fused"`` with ``derivative="autograd"`` or a model that is not an EnergyTransformer.
    """

    def __init__(
        self,
        model: EnergyModel,
        tau: float = 1.0,
        derivative: Derivative = "analytic",
        mask: Mask = None,
        backend: Backend = "auto",
    ):
        super().__init__()
        if not isinstance(model, EnergyModel):
            raise TypeError(
                f"model must be an et_ode.EnergyModel (such as an EnergyTransformer), got {type(model).__name__}"
            )
        if isinstance(tau, bool) or not isinstance(tau, (int, float, numbers.Real)):
            raise TypeError(f"tau must be a real number, got {type(tau).__name__} {tau!r}")
        check_positive("tau", float(tau))
        if derivative not in DERIVATIVES:
            raise ValueError(f"derivative must be one of {DERIVATIVES}, got {derivative!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "fused" and derivative != "analytic":
            raise ValueError(f"backend='fused' is the closed form of derivative='analytic', got derivative={derivative!r}")
        if backend == "fused" and not isinstance(model, EnergyTransformer):
            raise ValueError(f"backend='fused' is the EnergyTransformer's fast path, got a {type(model).__name__}")
        self.model = model
        self.tau = float(tau)
        self.derivative = derivative
        self.mask = mask
        self.backend = backend
        fast = backend != "reference" and derivative == "analytic"
        self.fused = FusedGrad(model) if fast and isinstance(model, EnergyTransformer) else None
        self.evaluations = Evaluations()

    @property
    def nfe(self) -> int:
        """Number of evaluations of ``forward`` (and counted work) since the last reset, by all threads (a solve's own
        count is in its ``Solution.stats``)."""
        return self.evaluations.count

    def reset_nfe(self) -> None:
        self.evaluations.count = 0

    def count_evaluations(self, evaluations: int = 1) -> None:
        """Add ``evaluations`` to ``nfe``: for methods that evaluate ``dE/dg`` (or a Hessian-vector product) through
        :meth:`dE_dg` rather than ``forward``, so that ``nfe`` counts all the work done with this field.

        Args:
            evaluations: the number of evaluations to add.
        """
        self.evaluations.add(evaluations)

    def with_mask(self, mask: Mask) -> ETField:
        """A copy of this field bound to ``mask``, sharing the model and the evaluation counter.

        Args:
            mask: boolean ``(N, N)`` or ``(*batch, N, N)`` (True where a query may attend to a key), a
                :class:`~et_ode.GraphMask`, or None (all pairs allowed).

        Returns:
            The bound field.
        """
        bound = copy.copy(self)
        bound.__dict__["mask"] = mask
        return bound

    def select(self, index: Tensor | int | slice) -> ETField:
        """This field for the samples ``index`` of the leading batch dimension (a flattened batch ``(B, N, D)``):
        a per-sample mask ``(B, N, N)`` is cut to ``mask[index]``; a shared mask (``(N, N)``, a
        :class:`~et_ode.GraphMask`, None) serves every sample and is kept. Shares the model and the evaluation
        counter (:meth:`with_mask`).

        Args:
            index: the samples, as for indexing a tensor's first dimension.

        Returns:
            The field for those samples.
        """
        mask = self.mask
        return self.with_mask(mask[index]) if isinstance(mask, Tensor) and mask.dim() > 2 else self

    # -- the dynamics ------------------------------------------------------------------------------
    def activation(self, x: Tensor) -> Tensor:
        """``g = neuron(x)``; on the fused path by the one-kernel ``layer_norm`` (the same formula as the LayerNorm
        neuron).

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``g``, ``(..., N, D)``.
        """
        neuron = self.model.neuron
        if self.fused is None or type(neuron) is not LayerNormNeuron:
            return neuron(x)
        return F.layer_norm(x, (neuron.dim,), neuron.gamma.expand(neuron.dim), neuron.delta, neuron.eps)

    def energy_g(self, g: Tensor) -> Tensor:
        """Total energy per sample as a function of ``g``, with the bound mask.

        Args:
            g: activations ``(..., N, D)``.

        Returns:
            The energy per sample, ``(...)``.
        """
        return self.model._energy_g(g, self.mask)

    def energy(self, x: Tensor) -> Tensor:
        """Total energy per sample of the state ``x``, with the bound mask.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            The energy per sample, ``(...)``.
        """
        return self.energy_g(self.model.neuron(x))

    def dE_dg(self, g: Tensor) -> Tensor:
        """``dE/dg`` by the chosen derivative and back end, with the bound mask. Not counted in ``nfe`` (see
        :meth:`count_evaluations`).

        Args:
            g: activations ``(..., N, D)``.

        Returns:
            ``dE/dg``, ``(..., N, D)``.
        """
        if self.derivative == "analytic":
            mask = self.mask
            if self.fused is not None and not isinstance(mask, GraphMask) and self.fused.supports(g, mask):
                return self.fused(g, mask)
            return self.model._dE_dg(g, self.mask)
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            if not g.requires_grad:
                g = g.detach().requires_grad_(True)
            energy = self.model._energy_g(g, self.mask).sum()
            (grad,) = torch.autograd.grad(energy, g, create_graph=create_graph)
        return grad

    def forward(self, t: Tensor | None, x: Tensor, *, out: Tensor | None = None) -> Tensor:
        """``dx/dt`` at ``x``, the right-hand side an ODE solver calls. Counted in ``nfe``.

        Args:
            t: the time (unused: the field is autonomous).
            x: states ``(..., N, D)``.
            out: see :meth:`velocity`.

        Returns:
            ``dx/dt``, ``(..., N, D)``.
        """
        self.evaluations.add()
        return self.velocity(x) if out is None else self.velocity(x, out=out)

    def velocity(self, x: Tensor, *, out: Tensor | None = None) -> Tensor:
        """``dx/dt = -(1/tau) dE/dg`` at ``x``, not counted in ``nfe``.

        Args:
            x: states ``(..., N, D)``.
            out: a tensor of ``x``'s shape, dtype and device to write ``dx/dt`` into and return, under
                ``torch.no_grad()`` (the fused field's last product writes a contiguous one directly); None: a new
                tensor.

        Returns:
            ``dx/dt``, ``(..., N, D)``.

        Raises:
            ValueError: ``out`` of another shape, dtype or device than ``x``, or given outside ``torch.no_grad()``.
        """
        if out is not None:
            _check_out(x, out)
        g = self.activation(x)
        mask = self.mask
        if (
            self.tau == 1.0
            and self.derivative == "analytic"
            and self.fused is not None
            and not isinstance(mask, GraphMask)
            and self.fused.supports(g, mask)
        ):  # the sign folded into the weights: one pass less
            if out is None or out.is_contiguous():  # the last product writes a contiguous out itself
                return self.fused(g, mask, negate=True, out=out)
            return out.copy_(self.fused(g, mask, negate=True))
        grad = self.dE_dg(g)
        if grad.requires_grad or self.fused is None:
            result = grad / -self.tau
            return result if out is None else out.copy_(result)
        # a fresh tensor of the fused path: scaled in place or into out, the same bits as above
        return grad.div_(-self.tau) if out is None else torch.div(grad, -self.tau, out=out)

    def _checked(self, x: Tensor) -> Tensor:
        check_tokens("x", x, self.model.dim, like=self.model.reference_tensor)
        check_mask(self.mask, x)
        return x

    # -- diagnostics (not counted in ``nfe``) ------------------------------------------------------
    def dg_dt(self, x: Tensor, velocity: Tensor | None = None) -> Tensor:
        """``dg/dt = M dx/dt``, the motion of the attractor's coordinates.

        Args:
            x: states ``(..., N, D)``.
            velocity: ``dx/dt`` at ``x`` when already computed (then ``x`` is not validated again), or None.

        Returns:
            ``dg/dt``, ``(..., N, D)``.

        Raises:
            TypeError, ValueError: ``x`` (without ``velocity``) is not a valid state of the model (named ``x``).
        """
        if velocity is None:
            velocity = self.velocity(self._checked(x))
        return self.model.neuron.hessian_vector(x, velocity)

    def tangent_gradient(self, x: Tensor, velocity: Tensor | None = None) -> Tensor:
        """``dE/dg`` where the attractors lie, zero exactly at a critical point there: shape of ``x``. On the spheres
        (the LayerNorm neuron) ``T dE/dg``: ``dE/dg`` with each token's mean and radial component (along
        ``s_A = (g_A - delta) / r_A``) removed, the gradient of ``E`` on the product of per-token spheres (see
        :mod:`et_ode.dynamics.manifold`); for a Euclidean neuron ``dE/dg`` without the directions every ``M_A``
        annihilates (:meth:`~et_ode.Neuron.project`).

        Args:
            x: states ``(..., N, D)``.
            velocity: as in :meth:`dg_dt`.

        Returns:
            The tangent gradient, ``(..., N, D)``.
        """
        neuron = self.model.neuron
        g = neuron(x if velocity is not None else self._checked(x))
        grad = self.dE_dg(g) if velocity is None else velocity * -self.tau
        if not isinstance(neuron, LayerNormNeuron):
            return neuron.project(grad)
        s, _ = radial_direction(g, neuron.delta)
        return tangent_projection(grad, s)

    def rms_dg_dt(self, x: Tensor, velocity: Tensor | None = None) -> Tensor:
        """Root-mean-square of ``dg/dt`` over tokens and elements, per sample.

        Args:
            x: states ``(..., N, D)``.
            velocity: as in :meth:`dg_dt`.

        Returns:
            RMS ``|dg/dt|``, ``(...)``.
        """
        return _rms(self.dg_dt(x, velocity))

    def rms_tangent_gradient(self, x: Tensor, velocity: Tensor | None = None) -> Tensor:
        """Root-mean-square of :meth:`tangent_gradient` over tokens and elements, per sample.

        Args:
            x: states ``(..., N, D)``.
            velocity: as in :meth:`dg_dt`.

        Returns:
            RMS ``|T dE/dg|`` (on the spheres), ``(...)``.
        """
        return _rms(self.tangent_gradient(x, velocity))

    def dE_dt(self, x: Tensor, velocity: Tensor | None = None) -> Tensor:
        """The exact ``dE/dt = -(1/tau) sum_A (dE/dg_A)^T M_A (dE/dg_A)`` per sample.

        Args:
            x: states ``(..., N, D)``.
            velocity: as in :meth:`dg_dt` (then ``dE/dt = -tau sum_A dx/dt_A . M_A dx/dt_A``, no evaluation).

        Returns:
            ``dE/dt``, ``(...)``.
        """
        if velocity is not None:
            return -self.tau * (velocity * self.dg_dt(x, velocity)).sum(dim=(-1, -2))
        self._checked(x)
        grad = self.dE_dg(self.model.neuron(x))
        return -(grad * self.model.neuron.hessian_vector(x, grad)).sum(dim=(-1, -2)) / self.tau

    def check_weights(self) -> None:
        """Every floating-point parameter of the field's model is finite: a ValueError naming the first that holds NaN or
        infinite values (the dynamics are then undefined, and a solve would fail far from the cause)."""
        named = [(name, p) for name, p in self.model.named_parameters() if p.is_floating_point() and p.numel()]
        if not named:
            return
        with torch.no_grad():  # each one's largest |value| (NaN where it holds one): three kernels for them all
            finite = torch.stack(torch._foreach_max(torch._foreach_abs([p for _, p in named]))).isfinite()
        if bool(finite.all()):  # one synchronisation for all the parameters
            return
        name = named[int((~finite).nonzero()[0])][0]
        raise ValueError(
            f"the model's parameter {name!r} holds NaN or infinite values, so the dynamics are "
            f"undefined; reload the weights (a diverged training step?)"
        )


def _check_out(x: Tensor, out: Tensor) -> None:
    """ValueError naming ``out`` unless it can hold the velocity at ``x`` without gradients."""
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must have x's shape, dtype and device {tuple(x.shape)}, {x.dtype}, {x.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    if torch.is_grad_enabled():
        raise ValueError("out is for evaluations without gradients: call under torch.no_grad()")


def _rms(v: Tensor) -> Tensor:
    """RMS over the last two dimensions (tokens and elements): ``(..., N, D) -> (...)``."""
    return v.square().mean(dim=(-1, -2)).sqrt()
