"""An independent long-flow reference: where the ET's flow ``tau dx/dt = -dE/dg`` from one state ends.

The right-hand side is :mod:`tests.fd_reference`'s einsum transcription of the SPEC (``spec_layer_norm``,
``spec_energy``, differentiated by autograd), fed with a model's raw tensors; nothing here calls the library's
energies, fields or solvers. The integrator is scipy's DOP853 (``solve_ivp``) in float64, one sample at a time.

**Time change.** Integrates in the time-changed variable ``s`` with ``dt = sigma_min(x) ds``, where ``sigma_A =
sqrt(mean(xt_A^2) + eps)`` and ``sigma_min`` is the smallest over the tokens: ``dx/ds = sigma_min(x) dx/dt``.
A time change leaves the path of ``x`` (so of ``g``) unchanged, and undoes the ``1/sigma`` slow-down of the
tangential motion as ``|xt|`` drifts outward: the approach to a minimum on the spheres is exponential in ``s``
instead of a power law in ``t``. The mean of ``dx/dt`` along the all-ones vector, which does not enter ``g``, is
dropped (``x`` stays centred).

**Rescaling.** Scales grow exponentially in ``s`` on the spheres, so once every token's ``sigma_A`` exceeds
``upper = 1e14 sqrt(eps)`` the sample is shrunk by one common factor to ``sigma_min = lower = 1e8 sqrt(eps)``;
``g`` then moves by ``O(eps / lower^2) = 1e-16`` relative, below rounding. A flow heading inward, to a fixed
point in ``x`` at finite scale, is never rescaled (nor grown).

**Stopping.** Per token the residual is ``|T dE/dg_A|`` (``T`` the projection onto the tangent space of the
token's sphere: the token's mean and its component along ``s_A = (g_A - delta)_c / |(g_A - delta)_c|``
removed) together with a radial part: ``|rho_A|`` for ``rho_A = -s_A . dE/dg_A <= 0`` (an inward force: the
token is not at rest until it vanishes), and ``min(rho_A, gap_A)`` for ``rho_A > 0``, ``gap_A = gamma sqrt(D) -
|(g_A - delta)_c|`` the distance left to the limit sphere (at rest either on the sphere or at a finite-scale
point where the force vanishes). The flow is followed until the RMS over tokens of both parts is below ``tol``,
checked between segments of ``segment`` in ``s``.

**The limit.** Tokens whose radial part is the gap (``gap_A < rho_A``) are placed on their limit sphere, ``g_A =
delta + gamma sqrt(D) s_A``; the others keep ``g_A = LayerNorm(x)_A`` (finite scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.integrate import solve_ivp
from torch import Tensor
from torch.nn import functional as F

from .fd_reference import spec_energy, spec_layer_norm


@dataclass(frozen=True)
class SpecWeights:
    """A model's raw tensors in float64, as the SPEC's formulas take them: ``WK``, ``WQ`` ``(H, Y, D)``, ``xi``
    ``(K, D)``, ``gamma`` (0-d), ``delta`` ``(D,)``, ``beta`` ``(H,)``, ``beta_hn``, the Hopfield ``form``, ``eps``
    and ``self_attention``."""

    WK: Tensor
    WQ: Tensor
    xi: Tensor
    gamma: Tensor
    delta: Tensor
    beta: Tensor
    beta_hn: float
    form: str
    eps: float
    self_attention: bool

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> SpecWeights:
        """Read the tensors of an :class:`et_ode.EnergyTransformer` (attributes only: no library computation)."""
        neuron, attention, hopfield = model.neuron, model.attention, model.hopfield
        raw = neuron.gamma_raw.detach().to(torch.float64)
        gamma = F.softplus(raw) if neuron.positive_gamma else raw
        return cls(
            WK=attention.WK.detach().to(torch.float64),
            WQ=attention.WQ.detach().to(torch.float64),
            xi=hopfield.xi.detach().to(torch.float64),
            gamma=gamma,
            delta=neuron.delta.detach().to(torch.float64),
            beta=attention.beta.detach().to(torch.float64),
            beta_hn=float(hopfield.beta),
            form=str(hopfield.form),
            eps=float(neuron.eps),
            self_attention=bool(attention.self_attention),
        )

    @property
    def radius(self) -> float:
        """The limit spheres' radius ``gamma sqrt(D)``."""
        return float(self.gamma) * math.sqrt(self.delta.shape[0])

    def energy(self, g: Tensor, mask: Tensor | None = None) -> Tensor:
        """``E(g)`` per sample, ``(..., N, D) -> (...)``."""
        return spec_energy(
            g,
            self.WK,
            self.WQ,
            self.xi,
            beta=self.beta,
            beta_hn=self.beta_hn,
            form=self.form,
            mask=mask,
            self_attention=self.self_attention,
        )

    def gradient(self, g: Tensor, mask: Tensor | None = None) -> Tensor:
        """``dE/dg`` by autograd of :meth:`energy`, ``(..., N, D)``."""
        with torch.enable_grad():
            g = g.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.energy(g, mask).sum(), g)
        return grad


@dataclass
class FlowLimit:
    """Where the flow from one state ends.

    Attributes:
        g: the limit ``(N, D)`` (tokens on their limit spheres placed exactly on them, see the module docstring).
        x: the last state ``(N, D)`` (centred; at the scale the integration reached).
        energy: ``E(g)``.
        tangent_gradient: RMS over tokens of ``|T dE/dg|`` at the last state.
        residual: RMS over tokens of the tangent and radial parts (the stopping measure).
        rho: the outward forces ``rho_A = -s_A . dE/dg_A`` ``(N,)`` at the last state.
        on_sphere: ``(N,)`` bool, the tokens placed on their limit spheres.
        converged: ``residual < tol``.
        s: the time-changed time reached.
        evaluations: right-hand-side evaluations.
    """

    g: Tensor
    x: Tensor
    energy: float
    tangent_gradient: float
    residual: float
    rho: Tensor
    on_sphere: Tensor
    converged: bool
    s: float
    evaluations: int


def _scales(x: Tensor, eps: float) -> Tensor:
    """``sigma_A = sqrt(mean(xt_A^2) + eps)`` per token, ``(N, D) -> (N,)``."""
    xt = x - x.mean(dim=-1, keepdim=True)
    return torch.sqrt(xt.square().mean(dim=-1) + eps)


def _measures(weights: SpecWeights, x: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
    """``g``, the unit radial ``s``, ``rho``, ``gap``, ``|T dE/dg_A|`` and the radial part, per token."""
    g = spec_layer_norm(x, weights.gamma, weights.delta, weights.eps)
    grad = weights.gradient(g, mask)
    u = g - weights.delta
    u = u - u.mean(dim=-1, keepdim=True)
    length = u.norm(dim=-1)
    s = u / length.clamp_min(1e-300)[:, None]
    centred = grad - grad.mean(dim=-1, keepdim=True)
    rho = -(s * centred).sum(dim=-1)
    tangent = (centred + rho[:, None] * s).norm(dim=-1)
    gap = (weights.radius - length).clamp_min(0.0)
    radial = torch.where(rho > 0, torch.minimum(rho, gap), -rho)
    return {"g": g, "s": s, "rho": rho, "gap": gap, "tangent": tangent, "radial": radial}


def long_flow_limit(
    weights: SpecWeights,
    x0: Tensor,
    *,
    tau: float = 1.0,
    mask: Tensor | None = None,
    tol: float = 1e-11,
    rtol: float = 1e-10,
    atol: float = 1e-12,
    segment: float = 4.0,
    max_evaluations: int = 300_000,
) -> FlowLimit:
    """Follow the flow ``tau dx/dt = -dE/dg`` of ``weights`` from one state ``x0`` ``(N, D)`` until the residual
    (module docstring) is below ``tol``, with DOP853 at ``rtol``/``atol`` on the time-changed flow, checked every
    ``segment`` of ``s``; ``mask`` ``(N, N)`` as in the library (True where query ``C`` may attend to key ``B``).
    Stops unconverged (``converged=False``) after ``max_evaluations`` right-hand-side evaluations."""
    if x0.dim() != 2 or x0.shape[-1] != weights.delta.shape[0]:
        raise ValueError(f"x0 must be one state (N, D) with D={weights.delta.shape[0]}, got {tuple(x0.shape)}")
    shape, eps = x0.shape, weights.eps
    lower, upper = 1e8 * math.sqrt(eps), 1e14 * math.sqrt(eps)

    def rhs(_s: float, y: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(y).view(shape)
        g = spec_layer_norm(x, weights.gamma, weights.delta, eps)
        velocity = -weights.gradient(g, mask) / tau
        velocity = velocity - velocity.mean(dim=-1, keepdim=True)
        return (_scales(x, eps).min() * velocity).reshape(-1).numpy()

    def too_large(_s: float, y: np.ndarray) -> float:
        return math.log(float(_scales(torch.from_numpy(y).view(shape), eps).min())) - math.log(upper)

    too_large.terminal = True  # type: ignore[attr-defined]
    too_large.direction = 1.0  # type: ignore[attr-defined]

    x = x0.detach().to(torch.float64).clone()
    x = x - x.mean(dim=-1, keepdim=True)
    s, evaluations, step = 0.0, 0, None
    while True:
        measures = _measures(weights, x, mask)
        evaluations += 1
        residual = float((measures["tangent"].square() + measures["radial"].square()).mean().sqrt())
        if residual < tol or evaluations >= max_evaluations:
            break
        out = solve_ivp(
            rhs,
            (0.0, segment),
            x.reshape(-1).numpy(),
            method="DOP853",
            rtol=rtol,
            atol=atol,
            events=too_large,
            first_step=step,
        )
        if out.status < 0:
            raise RuntimeError(f"DOP853 failed at s = {s}: {out.message}")
        evaluations += int(out.nfev)
        s += float(out.t[-1])
        if len(out.t) > 2:
            step = min(float(out.t[-1] - out.t[-2]), segment)
        x = torch.from_numpy(out.y[:, -1].copy()).view(shape)
        sigma_min = float(_scales(x, eps).min())
        if sigma_min >= upper * (1 - 1e-9):
            x = x * (lower / sigma_min)
    on_sphere = measures["gap"] < measures["rho"]
    g = torch.where(on_sphere[:, None], weights.delta + weights.radius * measures["s"], measures["g"])
    energy = float(weights.energy(g, mask))
    return FlowLimit(
        g=g,
        x=x,
        energy=energy,
        tangent_gradient=float(measures["tangent"].square().mean().sqrt()),
        residual=residual,
        rho=measures["rho"],
        on_sphere=on_sphere,
        converged=residual < tol,
        s=s,
        evaluations=evaluations,
    )
