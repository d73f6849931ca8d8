"""The Energy Transformer block: a LayerNorm neuron and two energies of its activation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from et_ode.backend.devices import resolve_device
from et_ode.backend.memory import memory_named
from et_ode.energy.checks import check_mask, check_tokens
from et_ode.energy.energies import EnergyAttention, HopfieldForm, HopfieldMemory
from et_ode.energy.masks import Mask
from et_ode.energy.neurons import LayerNormNeuron, inverse_softplus


class EnergyTransformer(nn.Module):
    """``E(g) = E_ATT(g) + E_HN(g)`` with ``g = LayerNorm(x)`` (the mathematics page: neurons and energies).

    Args:
        dim: token size ``D``.
        heads: attention heads ``H``.
        head_dim: head dimension ``Y``.
        memories: Hopfield memories ``K`` (the paper uses ``4 D``).
        hopfield: ``"relu"`` (the paper), ``"softplus"`` (smooth rectifier) or ``"softmax"``.
        beta: attention inverse temperature, a scalar or one per head; default ``1/sqrt(Y)``.
        beta_hn: the Hopfield module's inverse temperature (softmax and softplus forms).
        self_attention: include ``B = C`` in the attention sum (the official code releases do).
        eps: the LayerNorm regularizer.
        positive_gamma: keep the LayerNorm scale positive by construction (see :class:`LayerNormNeuron`).
        dtype, device: of the parameters, as in PyTorch's modules. Constants are exact in every dtype: ``eps``
            and ``beta_hn`` are Python floats and ``beta`` is held in float64 (so ``.double()`` loses nothing).

    Shapes: ``x`` and ``g`` are ``(..., N, D)``; energies are per sample, shape ``(...)``;
    ``mask`` is a boolean ``(N, N)`` or ``(*batch, N, N)``, True where query ``C`` may attend to key ``B``.

    The public methods refuse, naming the argument, a state ``x``/``g`` that is not a floating tensor of the model's
    dtype or a mask of the wrong type (TypeError), and a wrong shape, N = 0, NaN/inf entries, a state on another
    device or a mask of the wrong shape (ValueError).

    Raises:
        ValueError: a bad setting, named (``dim``, ``heads``, ``head_dim``, ``memories``, ``hopfield``, ``beta``,
            ``beta_hn``, ``eps``), or a ``device`` this machine does not have.
        TypeError: a ``dtype`` that is not floating.
        et_ode.backend.memory.OutOfMemoryError: the weights do not fit in memory (naming the sizes).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        memories: int,
        *,
        hopfield: HopfieldForm = "relu",
        beta: float | Sequence[float] | Tensor | None = None,
        beta_hn: float | None = None,
        self_attention: bool = False,
        eps: float = 1e-5,
        positive_gamma: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (torch.float32 or torch.float64), got {dtype!r}")
        if device is not None:
            resolve_device(device)  # a device this machine has (ValueError naming it otherwise)
        self.dim = dim
        sizes = f"EnergyTransformer(dim={dim!r}, heads={heads!r}, head_dim={head_dim!r}, memories={memories!r})"
        with memory_named(sizes, "its weights (2 H Y D + K D numbers) do not fit: choose smaller sizes"):
            self.neuron = LayerNormNeuron(dim, eps=eps, positive_gamma=positive_gamma, dtype=dtype, device=device)
            self.attention = EnergyAttention(
                dim, heads, head_dim, beta=beta, self_attention=self_attention, dtype=dtype, device=device
            )
            self.hopfield = HopfieldMemory(dim, memories, form=hopfield, beta=beta_hn, dtype=dtype, device=device)

    @classmethod
    def from_tensors(
        cls,
        WK: Tensor,
        WQ: Tensor,
        xi: Tensor,
        gamma: float | Tensor,
        delta: Tensor,
        *,
        beta: float | Sequence[float] | Tensor | None = None,
        beta_hn: float | None = None,
        eps: float = 1e-5,
        hopfield: HopfieldForm = "relu",
        self_attention: bool = False,
    ) -> EnergyTransformer:
        """A model holding exactly these weights, in the paper's layout.

        ``WK``, ``WQ``: ``(H, Y, D)``; ``xi``: ``(K, D)``; ``gamma``: positive scalar; ``delta``: ``(D,)``.
        The model takes the dtype and device of ``WK``.
        """
        WK, WQ, xi, delta = (torch.as_tensor(t) for t in (WK, WQ, xi, delta))
        if WK.dim() != 3:
            raise ValueError(f"WK must have shape (H, Y, D), got {tuple(WK.shape)}")
        if WQ.shape != WK.shape:
            raise ValueError(f"WQ must have the shape of WK {tuple(WK.shape)}, got {tuple(WQ.shape)}")
        heads, head_dim, dim = WK.shape
        if xi.dim() != 2 or xi.shape[1] != dim:
            raise ValueError(f"xi must have shape (K, D) with D={dim}, got {tuple(xi.shape)}")
        if delta.shape != (dim,):
            raise ValueError(f"delta must have shape ({dim},), got {tuple(delta.shape)}")
        gamma_value = float(gamma.detach()) if isinstance(gamma, Tensor) else float(gamma)
        if not gamma_value > 0:
            raise ValueError(f"gamma must be positive, got {gamma_value}")
        model = cls(
            dim,
            heads,
            head_dim,
            xi.shape[0],
            hopfield=hopfield,
            beta=beta,
            beta_hn=beta_hn,
            self_attention=self_attention,
            eps=eps,
            dtype=WK.dtype,
            device=WK.device,
        )
        with torch.no_grad():
            model.attention.WK.copy_(WK)
            model.attention.WQ.copy_(WQ)
            model.hopfield.xi.copy_(xi)
            model.neuron.delta.copy_(delta)
            model.neuron.gamma_raw.copy_(torch.tensor(inverse_softplus(gamma_value), dtype=torch.float64))
        return model

    # -- unchecked internals, used on hot paths (the vector field) -----------------------------
    def _energy_g(self, g: Tensor, mask: Mask) -> Tensor:
        return self.attention.energy(g, mask) + self.hopfield.energy(g)

    def _dE_dg(self, g: Tensor, mask: Mask) -> Tensor:
        return self.attention.dE_dg(g, mask) + self.hopfield.dE_dg(g)

    # -- public, validated ---------------------------------------------------------------------
    def activation(self, x: Tensor) -> Tensor:
        """``g = LayerNorm(x)``: ``(..., N, D) -> (..., N, D)``."""
        return self.neuron(check_tokens("x", x, self.dim, like=self.neuron.delta))

    def energy(self, x: Tensor, mask: Mask = None) -> Tensor:
        """Total energy per sample of the state ``x``: ``(..., N, D) -> (...)``."""
        g = self.activation(x)
        return self._energy_g(g, check_mask(mask, g))

    def energy_terms(self, x: Tensor, mask: Mask = None) -> dict[str, Tensor]:
        """``{"attention": E_ATT, "hopfield": E_HN}``, each per sample, shape ``(...)``."""
        g = self.activation(x)
        mask = check_mask(mask, g)
        return {"attention": self.attention.energy(g, mask), "hopfield": self.hopfield.energy(g)}

    def energy_g(self, g: Tensor, mask: Mask = None) -> Tensor:
        """Total energy per sample as a function of ``g``: ``(..., N, D) -> (...)``."""
        check_tokens("g", g, self.dim, like=self.neuron.delta)
        return self._energy_g(g, check_mask(mask, g))

    def dE_dg(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``dE/dg`` in closed form: ``(..., N, D) -> (..., N, D)``."""
        check_tokens("g", g, self.dim, like=self.neuron.delta)
        return self._dE_dg(g, check_mask(mask, g))

    def extra_repr(self) -> str:
        a, h = self.attention, self.hopfield
        return (
            f"dim={self.dim}, heads={a.heads}, head_dim={a.head_dim}, memories={h.memories}, "
            f"hopfield={h.form!r}, self_attention={a.self_attention}, eps={self.neuron.eps}"
        )
