"""Energy models: a neuron and a sum of interaction energies of its activation. The Energy Transformer is one."""

from __future__ import annotations

import keyword
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from et_ode.backend.devices import resolve_device
from et_ode.backend.memory import memory_named
from et_ode.energy.checks import check_mask, check_tokens
from et_ode.energy.energies import EnergyAttention, HopfieldForm, HopfieldMemory, Interaction
from et_ode.energy.masks import Mask
from et_ode.energy.neurons import GEOMETRIES, LayerNormNeuron, Neuron, inverse_softplus


class EnergyModel(nn.Module):
    """``E(g) = sum_i E_i(g)`` with ``g = neuron(x)``: a :class:`~et_ode.energy.neurons.Neuron` and a sum of
    :class:`~et_ode.energy.energies.Interaction` energies of its activation.

    Every tool of the library (:class:`~et_ode.ETField`, ``solve``, ``find_attractor``, ``et_ode.analysis``) takes
    any such model; the geometry of its attractors follows the neuron's ``geometry``.

    Args:
        neuron: the neuron (its ``dim`` is the token size ``D``).
        interactions: the energies, a mapping ``{name: interaction}`` (the names of :meth:`energy_terms`, and of the
            submodules) or a sequence (named ``"0"``, ``"1"``, ...); at least one.

    Shapes: ``x`` and ``g`` are ``(..., N, D)``; energies are per sample, shape ``(...)``; ``mask`` is ``None``, a
    boolean ``(N, N)`` or ``(*batch, N, N)`` tensor (True where query ``C`` may attend to key ``B``) or a
    :class:`~et_ode.energy.masks.GraphMask`, handed to every interaction.

    The public methods refuse, naming the argument, what :class:`EnergyTransformer`'s refuse.

    Raises:
        TypeError: a ``neuron`` that is not a Neuron, or an interaction that is not an Interaction.
        ValueError: no interactions, a name that is not an identifier (or is ``"neuron"``), or a geometry other than
            ``"euclidean"`` and ``"spheres"`` (which only a LayerNormNeuron has).
    """

    neuron: Neuron

    def __init__(self, neuron: Neuron, interactions: Mapping[str, Interaction] | Sequence[Interaction]):
        super().__init__()
        if not isinstance(neuron, Neuron):
            raise TypeError(f"neuron must be an et_ode.Neuron, got {type(neuron).__name__}")
        if neuron.geometry not in GEOMETRIES or (neuron.geometry == "spheres" and not isinstance(neuron, LayerNormNeuron)):
            raise ValueError(
                f"neuron {type(neuron).__name__} declares geometry {neuron.geometry!r}: it must be one of {GEOMETRIES}, "
                "and 'spheres' is the LayerNorm neuron's (subclass et_ode.LayerNormNeuron)"
            )
        items = list(interactions.items()) if isinstance(interactions, Mapping) else list(enumerate(interactions))
        if not items:
            raise ValueError("interactions must hold at least one et_ode.Interaction")
        self.neuron = neuron
        names = []
        for key, interaction in items:
            name = str(key)
            if not isinstance(interaction, Interaction):
                raise TypeError(f"interaction {name!r} must be an et_ode.Interaction, got {type(interaction).__name__}")
            if not (name.isdigit() or name.isidentifier()) or keyword.iskeyword(name) or name == "neuron":
                raise ValueError(f"interaction names must be identifiers other than 'neuron', got {name!r}")
            self.add_module(name, interaction)
            names.append(name)
        self.interaction_names = tuple(names)

    @property
    def dim(self) -> int:
        """The token size ``D`` (the neuron's)."""
        return self.neuron.dim

    @property
    def interactions(self) -> dict[str, Interaction]:
        """The interaction energies by name."""
        return {name: getattr(self, name) for name in self.interaction_names}

    @property
    def reference_tensor(self) -> Tensor | None:
        """The model's first floating-point parameter (the dtype and device a state must have), or None for a model
        without one."""
        return next((p for p in self.parameters() if p.is_floating_point()), None)

    # -- unchecked internals, used on hot paths (the vector field) -----------------------------
    def _energy_g(self, g: Tensor, mask: Mask) -> Tensor:
        terms = [getattr(self, name).energy(g, mask) for name in self.interaction_names]
        return sum(terms[1:], terms[0])

    def _dE_dg(self, g: Tensor, mask: Mask) -> Tensor:
        terms = [getattr(self, name).dE_dg(g, mask) for name in self.interaction_names]
        return sum(terms[1:], terms[0])

    # -- public, validated ---------------------------------------------------------------------
    def activation(self, x: Tensor) -> Tensor:
        """``g = neuron(x)``.

        Args:
            x: states ``(..., N, D)``.

        Returns:
            ``g``, ``(..., N, D)``.

        Raises:
            TypeError, ValueError: as :meth:`energy`.
        """
        return self.neuron(check_tokens("x", x, self.dim, like=self.reference_tensor))

    def energy(self, x: Tensor, mask: Mask = None) -> Tensor:
        """Total energy per sample of the state ``x``.

        Args:
            x: states ``(..., N, D)``.
            mask: boolean ``(N, N)`` or ``(*batch, N, N)``, True where query ``C`` may attend to key ``B``; a
                :class:`~et_ode.GraphMask`; or None (all pairs).

        Returns:
            The energy per sample, ``(...)``.

        Raises:
            TypeError: the state is not a floating tensor of the model's dtype, or the mask not a mask.
            ValueError: the state has the wrong shape, no token, NaN/inf entries or another device, or the mask
                does not fit it.
        """
        g = self.activation(x)
        return self._energy_g(g, check_mask(mask, g))

    def energy_terms(self, x: Tensor, mask: Mask = None) -> dict[str, Tensor]:
        """Each interaction's energy per sample, by name (the ET's: ``"attention"``, ``"hopfield"``).

        Args:
            x: states ``(..., N, D)``.
            mask: as in :meth:`energy`.

        Returns:
            A dict of energies per sample, each ``(...)``.

        Raises:
            TypeError, ValueError: as :meth:`energy`.
        """
        g = self.activation(x)
        mask = check_mask(mask, g)
        return {name: interaction.energy(g, mask) for name, interaction in self.interactions.items()}

    def energy_g(self, g: Tensor, mask: Mask = None) -> Tensor:
        """Total energy per sample as a function of ``g``.

        Args:
            g: activations ``(..., N, D)``.
            mask: as in :meth:`energy`.

        Returns:
            The energy per sample, ``(...)``.

        Raises:
            TypeError, ValueError: as :meth:`energy`.
        """
        check_tokens("g", g, self.dim, like=self.reference_tensor)
        return self._energy_g(g, check_mask(mask, g))

    def dE_dg(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``dE/dg``: each interaction's closed form, or autograd where it has none.

        Args:
            g: activations ``(..., N, D)``.
            mask: as in :meth:`energy`.

        Returns:
            ``dE/dg``, ``(..., N, D)``.

        Raises:
            TypeError, ValueError: as :meth:`energy`.
        """
        check_tokens("g", g, self.dim, like=self.reference_tensor)
        return self._dE_dg(g, check_mask(mask, g))


class EnergyTransformer(EnergyModel):
    """``E(g) = E_ATT(g) + E_HN(g)`` with ``g = LayerNorm(x)`` (the mathematics page: neurons and energies): the
    :class:`EnergyModel` of a :class:`~et_ode.energy.neurons.LayerNormNeuron` and the interactions ``"attention"``
    (:class:`~et_ode.energy.energies.EnergyAttention`) and ``"hopfield"``
    (:class:`~et_ode.energy.energies.HopfieldMemory`). :class:`~et_ode.ETField` evaluates its ``dE/dg`` on a fused
    fast path (:mod:`et_ode.kernels.fused`).

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

    neuron: LayerNormNeuron
    attention: EnergyAttention
    hopfield: HopfieldMemory

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
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype (torch.float32 or torch.float64), got {dtype!r}")
        if device is not None:
            resolve_device(device)  # a device this machine has (ValueError naming it otherwise)
        sizes = f"EnergyTransformer(dim={dim!r}, heads={heads!r}, head_dim={head_dim!r}, memories={memories!r})"
        with memory_named(sizes, "its weights (2 H Y D + K D numbers) do not fit: choose smaller sizes"):
            neuron = LayerNormNeuron(dim, eps=eps, positive_gamma=positive_gamma, dtype=dtype, device=device)
            attention = EnergyAttention(
                dim, heads, head_dim, beta=beta, self_attention=self_attention, dtype=dtype, device=device
            )
            memory = HopfieldMemory(dim, memories, form=hopfield, beta=beta_hn, dtype=dtype, device=device)
        super().__init__(neuron, {"attention": attention, "hopfield": memory})

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
        """A model holding exactly these weights, in the paper's layout; it takes the dtype and device of ``WK``.

        Args:
            WK, WQ: key and query weights ``(H, Y, D)``.
            xi: Hopfield memories ``(K, D)``.
            gamma: the LayerNorm scale, a positive scalar.
            delta: the LayerNorm shift ``(D,)``.
            beta, beta_hn, eps, hopfield, self_attention: as in :class:`EnergyTransformer`.

        Returns:
            The :class:`EnergyTransformer`.

        Raises:
            ValueError: a weight of the wrong shape, or ``gamma`` not positive.
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

    def extra_repr(self) -> str:
        a, h = self.attention, self.hopfield
        return (
            f"dim={self.dim}, heads={a.heads}, head_dim={a.head_dim}, memories={h.memories}, "
            f"hopfield={h.form!r}, self_attention={a.self_attention}, eps={self.neuron.eps}"
        )
