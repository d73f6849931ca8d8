"""Independent references for the gradient tests: the SPEC's energy written out again, and central differences.

Nothing here calls the library's energies, fields or backward passes: ``spec_velocity`` is SPEC sections 1-4
transcribed with ``einsum`` and differentiated by autograd, and ``directional_derivative`` only evaluates a
loss. Shapes follow the library: states ``(..., N, D)``, masks ``(..., N, N)`` with ``mask[..., C, B]`` True
where query ``C`` may attend to key ``B``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F


def spec_layer_norm(x: Tensor, gamma: Tensor, delta: Tensor, eps: float) -> Tensor:
    """SPEC section 1: ``g = gamma (x - mean) / sqrt(var + eps) + delta`` per token."""
    centered = x - x.mean(dim=-1, keepdim=True)
    return gamma * centered / torch.sqrt(centered.square().mean(dim=-1, keepdim=True) + eps) + delta


def spec_energy(
    g: Tensor,
    WK: Tensor,
    WQ: Tensor,
    xi: Tensor,
    *,
    beta: Tensor,
    beta_hn: float,
    form: str,
    mask: Tensor | None = None,
    self_attention: bool = False,
) -> Tensor:
    """SPEC sections 2-3: ``E_ATT + E_HN`` per sample, ``(..., N, D) -> (...)``; ``beta`` one value per head."""
    keys = torch.einsum("hyd,...bd->...hby", WK, g)
    queries = torch.einsum("hyd,...cd->...hcy", WQ, g)
    scores = torch.einsum("...hby,...hcy->...hbc", keys, queries)  # A[h, B, C]
    n = g.shape[-2]
    allowed = torch.ones(n, n, dtype=torch.bool) if self_attention else ~torch.eye(n, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask.transpose(-1, -2)  # allowed[B, C]
    allowed = allowed.unsqueeze(-3).expand(scores.shape)
    logits = (beta[:, None, None] * scores).masked_fill(~allowed, -math.inf)
    has_key = allowed.any(dim=-2)  # (..., H, C)
    lse = torch.logsumexp(logits.masked_fill(~has_key.unsqueeze(-2), 0.0), dim=-2)
    attention = -(torch.where(has_key, lse, torch.zeros_like(lse)) / beta[:, None]).sum(dim=(-1, -2))
    overlaps = g @ xi.T
    if form == "relu":
        memory = -0.5 * torch.relu(overlaps).square().sum(dim=(-1, -2))
    elif form == "softplus":
        # log(1 + e^x) as logaddexp(x, 0): exact at every x, independent of the library's softplus
        rectified = torch.logaddexp(beta_hn * overlaps, torch.zeros((), dtype=overlaps.dtype)) / beta_hn
        memory = -0.5 * rectified.square().sum(dim=(-1, -2))
    else:
        memory = -(torch.logsumexp(beta_hn * overlaps, dim=-1) / beta_hn).sum(dim=-1)
    return attention + memory


def spec_velocity(
    model: torch.nn.Module, x: Tensor, *, tau: float, mask: Tensor | None = None, create_graph: bool = False
) -> Tensor:
    """``dx/dt = -(1/tau) dE/dg`` from the SPEC's formulas and the model's raw tensors, by autograd of the energy."""
    neuron, attention, hopfield = model.neuron, model.attention, model.hopfield
    gamma = F.softplus(neuron.gamma_raw) if neuron.positive_gamma else neuron.gamma_raw
    g = spec_layer_norm(x, gamma, neuron.delta, neuron.eps)
    with torch.enable_grad():
        if not g.requires_grad:
            g = g.detach().requires_grad_(True)
        energy = spec_energy(
            g,
            attention.WK,
            attention.WQ,
            hopfield.xi,
            beta=attention.beta.to(x.dtype),
            beta_hn=hopfield.beta,
            form=hopfield.form,
            mask=mask,
            self_attention=attention.self_attention,
        ).sum()
        (grad,) = torch.autograd.grad(energy, g, create_graph=create_graph)
    return -grad / tau


def spec_rk4(model: torch.nn.Module, x0: Tensor, *, tau: float, t1: float, steps: int, mask: Tensor | None = None) -> Tensor:
    """Classical fourth-order Runge-Kutta on ``spec_velocity`` from 0 to ``t1`` in ``steps`` steps."""
    x, h = x0, t1 / steps
    for _ in range(steps):
        k1 = spec_velocity(model, x, tau=tau, mask=mask)
        k2 = spec_velocity(model, x + 0.5 * h * k1, tau=tau, mask=mask)
        k3 = spec_velocity(model, x + 0.5 * h * k2, tau=tau, mask=mask)
        k4 = spec_velocity(model, x + h * k3, tau=tau, mask=mask)
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x


def directional_derivative(loss: Callable[[], Tensor], tensor: Tensor, direction: Tensor, h: float = 1e-6) -> float:
    """``(L(t + h d) - L(t - h d)) / 2h`` with ``tensor`` perturbed in place (and restored bit for bit)."""
    original = tensor.detach().clone()
    values = []
    with torch.no_grad():
        for sign in (1.0, -1.0):
            tensor.copy_(original + sign * h * direction)
            values.append(float(loss()))
        tensor.copy_(original)
    return (values[0] - values[1]) / (2 * h)


def richardson(loss: Callable[[], Tensor], tensor: Tensor, direction: Tensor, h: float = 1e-5) -> tuple[float, float]:
    """Richardson-extrapolated central difference ``(4 D(h/2) - D(h)) / 3`` and ``|D(h) - D(h/2)|``, an error
    estimate of the plain central difference."""
    coarse = directional_derivative(loss, tensor, direction, h)
    fine = directional_derivative(loss, tensor, direction, h / 2)
    return (4 * fine - coarse) / 3, abs(coarse - fine)


def relative_error(analytic: float, reference: float, scale: float) -> float:
    """``|a - r| / max(|r|, scale)``: relative where the reference is not tiny, absolute in units of ``scale``."""
    return abs(analytic - reference) / max(abs(reference), scale)
