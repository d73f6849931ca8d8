"""The ET vector field ``tau dx/dt = -dE/dg``: a plain ``nn.Module`` ``f(t, x)`` for any ODE solver."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ._checks import check_mask, check_tokens
from .fused import FusedGrad
from .model import EnergyTransformer
from .neurons import LayerNormNeuron

GRAD_MODES = ("analytic", "autograd")
BACKENDS = ("auto", "fused", "reference")


@dataclass
class Evaluations:
    """How many times a field was evaluated. Shared by copies of the field made by ``with_mask``."""

    count: int = 0


class ETField(nn.Module):
    """``f(t, x) = -(1/tau) dE/dg(g(x))`` for a state ``x`` of shape ``(..., N, D)``.

    Args:
        model: the energy.
        tau: time constant, positive and finite (ValueError otherwise).
        grad: ``"analytic"`` (closed form, the default) or ``"autograd"`` (differentiates the energy;
            the reference, also correct under ``torch.no_grad()``).
        mask: an attention mask bound to the field (see :class:`EnergyTransformer`).
        backend: how ``grad="analytic"`` evaluates ``dE/dg``: ``"fused"`` (:mod:`et_ode.fused`: two large
            matrix products on the fastest GEMM back end, and a closed-form Hessian-vector product as its
            backward), ``"reference"`` (the model's own closed form, differentiated by autograd), or
            ``"auto"`` (the default: fused wherever it applies). The fused path applies to masks that are
            ``None`` or dense boolean tensors; any other mask falls back to the model's ``_grad_g``.
            Its backward is first-order (no double backward through the field).

    The field counts its evaluations in ``nfe`` (``reset_nfe()`` zeroes it); the diagnostics ``dg_dt``,
    ``dE_dt`` and ``rms_dg_dt`` are not counted. ``forward`` does not
    validate its input, since solvers call it thousands of times; ``solve`` validates once.
    """

    def __init__(self, model: EnergyTransformer, tau: float = 1.0, grad: str = "analytic",
                 mask: Tensor | None = None, backend: str = "auto"):
        super().__init__()
        if not isinstance(model, EnergyTransformer):
            raise TypeError(f"model must be an EnergyTransformer, got {type(model).__name__}")
        if not (0 < float(tau) < math.inf):
            raise ValueError(f"tau must be positive and finite, got {tau!r}")
        if grad not in GRAD_MODES:
            raise ValueError(f"grad must be one of {GRAD_MODES}, got {grad!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "fused" and grad != "analytic":
            raise ValueError(f"backend='fused' is the closed form of grad='analytic', got grad={grad!r}")
        self.model = model
        self.tau = float(tau)
        self.grad_mode = grad
        self.mask = mask
        self.backend = backend
        self.fused = FusedGrad(model) if backend != "reference" and grad == "analytic" else None
        self.evaluations = Evaluations()

    @property
    def nfe(self) -> int:
        """Number of evaluations of ``forward`` since the last reset."""
        return self.evaluations.count

    def reset_nfe(self) -> None:
        self.evaluations.count = 0

    def count_evaluations(self, evaluations: int = 1) -> None:
        """Add ``evaluations`` to ``nfe``: for methods that evaluate ``dE/dg`` (or a Hessian-vector product) through
        :meth:`grad_g` rather than ``forward``, so that ``nfe`` counts all the work done with this field."""
        self.evaluations.count += evaluations

    def with_mask(self, mask: Tensor | None) -> ETField:
        """A copy of this field bound to ``mask``, sharing the model and the evaluation counter."""
        bound = copy.copy(self)
        bound.__dict__["mask"] = mask
        return bound

    def grad_g(self, g: Tensor) -> Tensor:
        """``dE/dg`` by the chosen mode, with the bound mask: ``(..., N, D) -> (..., N, D)``."""
        if self.grad_mode == "analytic":
            if self.fused is not None and self.fused.supports(g, self.mask):
                return self.fused(g, self.mask)
            return self.model._grad_g(g, self.mask)
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            if not g.requires_grad:
                g = g.detach().requires_grad_(True)
            energy = self.model._energy_g(g, self.mask).sum()
            (grad,) = torch.autograd.grad(energy, g, create_graph=create_graph)
        return grad

    def forward(self, t: Tensor, x: Tensor) -> Tensor:
        """``dx/dt``, shape of ``x``. Counted in ``nfe``."""
        self.evaluations.count += 1
        return self._velocity(x)

    def _velocity(self, x: Tensor) -> Tensor:
        """``dx/dt`` without counting it (for diagnostics)."""
        g = self._activation(x)
        if self.tau == 1.0 and self.grad_mode == "analytic" and self.fused is not None and self.fused.supports(g, self.mask):
            return self.fused(g, self.mask, negate=True)  # the sign folded into the weights: one pass less
        grad = self.grad_g(g)
        if grad.requires_grad or self.fused is None:
            return grad / -self.tau
        return grad.div_(-self.tau)  # a fresh tensor of the fused path: scaled in place, the same bits as above

    def _activation(self, x: Tensor) -> Tensor:
        """``g = LayerNorm(x)``; on the fused path by the one-kernel ``layer_norm`` (same formula as the neuron)."""
        neuron = self.model.neuron
        if self.fused is None or type(neuron) is not LayerNormNeuron:
            return neuron(x)
        return F.layer_norm(x, (neuron.dim,), neuron.gamma.expand(neuron.dim), neuron.delta, neuron.eps)

    def _checked(self, x: Tensor) -> Tensor:
        check_tokens("x", x, self.model.dim, like=self.model.neuron.delta)
        check_mask(self.mask, x)
        return x

    def dg_dt(self, x: Tensor) -> Tensor:
        """``dg/dt = M dx/dt`` (the motion of the attractor's coordinates): shape of ``x``."""
        self._checked(x)
        return self.model.neuron.hessian_vector(x, self._velocity(x))

    def dE_dt(self, x: Tensor) -> Tensor:
        """The exact ``dE/dt = -(1/tau) sum_A (dE/dg_A)^T M_A (dE/dg_A)`` per sample, shape ``x.shape[:-2]``."""
        self._checked(x)
        grad = self.grad_g(self.model.neuron(x))
        return -(grad * self.model.neuron.hessian_vector(x, grad)).sum(dim=(-1, -2)) / self.tau

    def rms_dg_dt(self, x: Tensor) -> Tensor:
        """Root-mean-square of ``dg/dt`` over tokens and elements, per sample, shape ``x.shape[:-2]``."""
        return self.dg_dt(x).square().mean(dim=(-1, -2)).sqrt()
