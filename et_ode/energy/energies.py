"""Interactions: energies of the activations ``g``. :class:`Interaction` is the public interface; the ET's two,
:class:`EnergyAttention` and :class:`HopfieldMemory`, each hold one energy and its closed-form gradient.

Shapes: ``g`` is ``(..., N, D)``; energies are returned per sample, shape ``(...)``; gradients
``dE/dg`` have the shape of ``g``. Masks (:mod:`et_ode.energy.masks`) follow PyTorch's convention: ``mask[..., C, B]``
is True where query token ``C`` may attend to key token ``B``; a :class:`~et_ode.energy.masks.GraphMask` selects the
edge-list form of the attention energy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from et_ode.backend.validation import check_positive
from et_ode.energy.masks import GraphMask, Mask, key_query


class Interaction(nn.Module):
    """An interaction energy of the activations ``g``: a module with :meth:`energy` and, optionally, a closed-form
    :meth:`dE_dg` (by default ``torch.func.grad`` of the energy, which also gives the Hessian-vector products the
    certificates and implicit gradients need, by autograd through it).

    A subclass writes ``energy(g, mask)``; ``mask`` is the field's mask (``None``, a boolean ``(*batch, N, N)``
    tensor or a :class:`~et_ode.energy.masks.GraphMask`), which an energy acting on each token alone ignores.
    """

    def energy(self, g: Tensor, mask: Mask = None) -> Tensor:
        """The interaction's energy of ``g`` per sample, ``(...)``.

        Args:
            g: activations ``(..., N, D)``.
            mask: the field's mask (see the class); True where query ``C`` may attend to key ``B``.

        Returns:
            The energy per sample.
        """
        raise NotImplementedError(f"{type(self).__name__} must define energy(g, mask)")

    def dE_dg(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``dE/dg``, differentiable in ``g`` and the parameters wherever autograd is on (by default
        ``torch.func.grad`` of :meth:`energy`).

        Args:
            g: activations ``(..., N, D)``.
            mask: as in :meth:`energy`.

        Returns:
            ``dE/dg``, ``(..., N, D)``.
        """
        return torch.func.grad(lambda point: self.energy(point, mask).sum())(g)


def _per_head(value: float | Sequence[float] | Tensor | None, heads: int, default: float, name: str) -> Tensor:
    """A positive value per head as a float64 tensor of shape ``(H,)``: Python floats and float64 tensors are
    held exactly, whatever the default dtype."""
    given = default if value is None else value
    beta = torch.as_tensor(given, dtype=torch.float64).detach().clone().cpu().reshape(-1)
    if beta.numel() == 1:
        beta = beta.expand(heads).clone()
    if beta.numel() != heads:
        raise ValueError(f"{name} must be a scalar or have one value per head ({heads}), got {beta.numel()} values")
    if not bool((beta > 0).all() and torch.isfinite(beta).all()):
        raise ValueError(f"{name} must be positive and finite, got {beta.tolist()}")
    return beta


def _without_diagonal(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(N, N)``: 0, and -inf on the diagonal; added to the logits, it leaves each token out of its own keys. Built
    where it is used, never kept (compiled code would guard on a kept one): cheaper than boolean masks with
    ``masked_fill`` and the test that each query keeps a key, in eager and compiled code alike (the performance page
    measures both), with the same numbers."""
    return torch.zeros(n, n, dtype=dtype, device=device).fill_diagonal_(-math.inf)


class EnergyAttention(Interaction):
    """Multi-head energy attention, no value matrix.

    ``E_ATT = -sum_h (1/beta_h) sum_C log sum_{B allowed for C} exp(beta_h K_hB . Q_hC)``

    Parameters ``WK``, ``WQ`` have the paper's layout ``(H, Y, D)``. By default a token does not
    attend to itself (``B != C``); ``self_attention=True`` includes the diagonal, as the official
    code releases do. A query token with no allowed key contributes nothing.

    With a :class:`~et_ode.energy.masks.GraphMask` (an edge list), the same energy in O(E) memory: with ``P(C)`` the
    keys ``B`` of query ``C`` (self-loops dropped unless ``self_attention``),

        E_ATT = -sum_h (1/beta_h) sum_{C: P(C) nonempty} log sum_{B in P(C)} exp(beta_h K_hB . Q_hC)
        dE_ATT/dg_D = -sum_h [ sum_{C: D in P(C)} S_h(D, C) WK_h^T Q_hC + sum_{B in P(D)} S_h(B, D) WQ_h^T K_hB ]

    where ``S_h(B, C)`` is a segment softmax of the edge logits over the incoming edges of each query ``C``;
    memory O(N H Y + E H Y).

    ``beta`` (shape ``(H,)``) is a constant, not a weight: it stays float64 whatever dtype the module is
    moved to, so a float64 model holds ``1/sqrt(Y)`` exactly; it is rounded to the computation's dtype where used.

    Args:
        dim: token dimension ``D``.
        heads: attention heads ``H``.
        head_dim: key and query dimension ``Y``.
        beta: inverse temperature, one for all heads or one per head ``(H,)``; default ``1/sqrt(Y)``.
        self_attention: whether a token attends to itself.
        init_std: standard deviation of the initial ``WK``, ``WQ``; default ``1/sqrt(D)``.
        dtype: dtype of the weights.
        device: device of the weights.

    Raises:
        ValueError: ``dim``, ``heads``, ``head_dim`` not positive integers, or ``beta`` not positive (or not one per
            head).
    """

    beta: Tensor  # (H,) float64 buffer, registered in __init__

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        *,
        beta: float | Sequence[float] | Tensor | None = None,
        self_attention: bool = False,
        init_std: float | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("head_dim", head_dim)):
            check_positive(name, value, integer=True)
        self.dim, self.heads, self.head_dim = dim, heads, head_dim
        self.self_attention = self_attention
        std = init_std if init_std is not None else 1.0 / math.sqrt(dim)
        self.WK = nn.Parameter(torch.randn(heads, head_dim, dim, dtype=dtype, device=device) * std)
        self.WQ = nn.Parameter(torch.randn(heads, head_dim, dim, dtype=dtype, device=device) * std)
        self.register_buffer("beta", _per_head(beta, heads, 1.0 / math.sqrt(head_dim), "beta").to(self.WK.device))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> EnergyAttention:
        """Moves and casts like any module, except that ``beta`` keeps its float64 values (see the class doc)."""
        beta = self.beta
        super()._apply(fn, recurse)
        self.beta = beta.to(self.beta.device)
        return self

    def _keys_queries(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and queries, each ``(..., H, N, Y)``, from one fused product with ``[WK; WQ]``."""
        h, y, d = self.heads, self.head_dim, self.dim
        weight = torch.cat([self.WK, self.WQ], dim=0).reshape(2 * h * y, d)
        kq = (g @ weight.T).unflatten(-1, (2, h, y))  # (..., N, 2, H, Y)
        kq = kq.movedim(-4, -2)  # (..., 2, H, N, Y)
        return kq[..., 0, :, :, :], kq[..., 1, :, :, :]

    def _allowed(self, n: int, mask: Tensor | None, device: torch.device) -> Tensor | None:
        """Boolean ``(..., 1, B, C)`` of allowed (key B, query C) pairs, or None when all are allowed."""
        allowed = None if mask is None else key_query(mask)
        if not self.self_attention:
            off_diagonal = ~torch.eye(n, dtype=torch.bool, device=device)
            allowed = off_diagonal if allowed is None else allowed & off_diagonal
        return None if allowed is None else allowed.unsqueeze(-3)

    def _logits(self, g: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``beta_h A[h, B, C]`` with disallowed pairs at -inf (and fully masked queries at 0)."""
        k, q = self._keys_queries(g)
        beta = self.beta.to(g.dtype)[:, None, None]
        logits = beta * (k @ q.transpose(-1, -2))  # (..., H, B, C)
        n = g.shape[-2]
        if mask is None and not self.self_attention and n > 1:  # every query keeps a key
            return logits + _without_diagonal(n, logits.dtype, g.device), k, q, None
        allowed = self._allowed(n, mask, g.device)
        has_key = None
        if allowed is not None:
            has_key = allowed.any(dim=-2, keepdim=True)  # (..., 1, 1, C)
            logits = logits.masked_fill(~allowed, -math.inf).masked_fill(~has_key, 0.0)
        return logits, k, q, has_key

    def energy(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``E_ATT`` per sample: ``(..., N, D) -> (...)``. A :class:`GraphMask` uses the edge-list form.

        Args:
            g: activations ``(..., N, D)``.
            mask: as in :meth:`Interaction.energy`.

        Returns:
            The energy per sample, ``(...)``.
        """
        if isinstance(mask, GraphMask):
            return self._edge_energy(g, mask)
        logits, _, _, has_key = self._logits(g, mask)
        lse = torch.logsumexp(logits, dim=-2)  # (..., H, C)
        if has_key is not None:
            lse = lse * has_key.squeeze(-2)
        return -(lse / self.beta.to(g.dtype)[:, None]).sum(dim=(-1, -2))

    def attention(self, g: Tensor, mask: Mask = None) -> Tensor:
        """Attention weights: softmax over keys ``B`` for each query ``C``.

        Args:
            g: activations ``(..., N, D)``.
            mask: as in :meth:`Interaction.energy`.

        Returns:
            ``S[..., h, B, C]``, ``(..., H, N, N)``; with a :class:`GraphMask`, the weights per edge ``(..., H, E)``,
            aligned with ``mask.edge_index``.
        """
        if isinstance(mask, GraphMask):
            return self._edge_attention(g, mask)
        logits, _, _, has_key = self._logits(g, mask)
        weights = torch.softmax(logits, dim=-2)
        return weights if has_key is None else weights * has_key

    def dE_dg(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``dE_ATT/dg`` in closed form: ``(..., N, D) -> (..., N, D)``.

        ``-sum_h [S_h Q_h WK_h + S_h^T K_h WQ_h]``: token D as a key, then as a query.
        A :class:`GraphMask` uses the edge-list form (segment softmax over each query's incoming edges).

        Args:
            g: activations ``(..., N, D)``.
            mask: as in :meth:`Interaction.energy`.

        Returns:
            ``dE/dg``, ``(..., N, D)``.
        """
        if isinstance(mask, GraphMask):
            return self._edge_dE_dg(g, mask)
        logits, k, q, has_key = self._logits(g, mask)
        weights = torch.softmax(logits, dim=-2)
        if has_key is not None:
            weights = weights * has_key
        d_keys = weights @ q  # (..., H, N, Y): sum_C S[B, C] Q[C]
        d_queries = weights.transpose(-1, -2) @ k  # sum_B S[B, C] K[B]
        both = torch.stack([d_keys, d_queries], dim=-4).movedim(-2, -4)  # (..., N, 2, H, Y)
        weight = torch.cat([self.WK, self.WQ], dim=0).reshape(-1, self.dim)
        return -(both.flatten(-3) @ weight)

    # -- the edge-list form (a GraphMask): O(E) memory ----------------------------------------------------
    def _edge_terms(self, g: Tensor, mask: GraphMask) -> dict[str, Tensor]:
        """Per-node keys/queries ``(..., N, H, Y)``, their per-edge gathers ``(..., E', H, Y)`` and the segment
        softmax ``S (..., E', H)`` with ``logsumexp (..., N, H)`` over each query's incoming edges."""
        h, y, d, n = self.heads, self.head_dim, self.dim, mask.num_nodes
        kept = mask.kept(self.self_attention)
        src, dst = mask.edge_index[0, kept], mask.edge_index[1, kept]
        weight = torch.cat([self.WK, self.WQ], dim=0).reshape(2 * h * y, d)
        kq = (g @ weight.T).unflatten(-1, (2, h, y))  # (..., N, 2, H, Y)
        k, q = kq[..., 0, :, :], kq[..., 1, :, :]
        k_src, q_dst = k.index_select(-3, src), q.index_select(-3, dst)  # (..., E', H, Y)
        logits = self.beta.to(g.dtype) * torch.linalg.vecdot(k_src, q_dst)  # (..., E', H)
        segment = dst.reshape(-1, 1).expand(logits.shape)
        peak = logits.new_full((*logits.shape[:-2], n, h), -torch.inf)
        peak = peak.scatter_reduce(-2, segment, logits.detach(), reduce="amax").detach()  # a stabilizer only
        exp = torch.exp(logits - peak.index_select(-2, dst))
        total = logits.new_zeros(peak.shape).index_add(-2, dst, exp)  # (..., N, H)
        weights = exp / total.index_select(-2, dst)
        return dict(
            k=k,
            q=q,
            k_src=k_src,
            q_dst=q_dst,
            weights=weights,
            peak=peak,
            total=total,
            src=src,
            dst=dst,
            kept=kept,
            weight=weight,
        )

    def _edge_energy(self, g: Tensor, mask: GraphMask) -> Tensor:
        """``E_ATT`` per sample on the graph: ``(..., N, D) -> (...)``."""
        terms = self._edge_terms(g, mask)
        has_key = torch.zeros(mask.num_nodes, dtype=torch.bool, device=g.device)
        has_key[terms["dst"]] = True
        lse = terms["peak"][..., has_key, :] + torch.log(terms["total"][..., has_key, :])  # (..., N', H)
        return -(lse / self.beta.to(g.dtype)).sum(dim=(-1, -2))

    def _edge_attention(self, g: Tensor, mask: GraphMask) -> Tensor:
        """Attention weights per edge, ``(..., H, E)``, aligned with ``mask.edge_index`` (the sparse form of
        ``S[..., h, B, C]``); excluded self-loops get weight 0."""
        terms = self._edge_terms(g, mask)
        weights = terms["weights"]
        full = weights.new_zeros((*weights.shape[:-2], mask.num_edges, self.heads))
        full = full.index_copy(-2, terms["kept"], weights)
        return full.movedim(-1, -2)

    def _edge_dE_dg(self, g: Tensor, mask: GraphMask) -> Tensor:
        """``dE_ATT/dg`` on the graph in closed form: ``(..., N, D) -> (..., N, D)``."""
        terms = self._edge_terms(g, mask)
        s = terms["weights"].unsqueeze(-1)  # (..., E', H, 1)
        d_keys = torch.zeros_like(terms["k"]).index_add(-3, terms["src"], s * terms["q_dst"])  # node as a key
        d_queries = torch.zeros_like(terms["q"]).index_add(-3, terms["dst"], s * terms["k_src"])  # node as a query
        both = torch.stack([d_keys, d_queries], dim=-3)  # (..., N, 2, H, Y)
        return -(both.flatten(-3) @ terms["weight"])


HopfieldForm = Literal["relu", "softmax", "softplus"]
HOPFIELD_FORMS: tuple[HopfieldForm, ...] = get_args(HopfieldForm)
# softplus(x) is computed as log(1 + e^x) up to here and as x beyond: the gap, log(1 + e^-x) < 4.3e-18, is below float64
# rounding (PyTorch's default switch at 20 leaves 2e-9, a float64 energy and its closed-form gradient then disagree)
SOFTPLUS_LINEAR_FROM = 40.0


def softplus(x: Tensor) -> Tensor:
    """``log(1 + e^x)``, elementwise, exact to the dtype's rounding (float64 included); any shape."""
    return nn.functional.softplus(x, threshold=SOFTPLUS_LINEAR_FROM)


class HopfieldMemory(Interaction):
    """Hopfield memories acting on each token alone.

    With overlaps ``h[B, mu] = xi_mu . g_B``:

    - ``"relu"`` (the paper): ``E = -1/2 sum relu(h)^2``. Its gradient has kinks where an overlap
      crosses zero, which limits how well adaptive solvers and their gradients converge.
    - ``"softplus"``: ``E = -1/2 sum r(h)^2`` with the smooth rectifier
      ``r(h) = softplus(s h) / s`` (``s = beta``, default 4): a C-infinity stand-in for ReLU.
    - ``"softmax"``: ``E = -(1/beta) sum_B log sum_mu exp(beta h[B, mu])`` (``beta`` default 1).

    Args:
        dim: token dimension ``D``.
        memories: number of memories ``M`` (``xi`` has shape ``(M, D)``).
        form: ``"relu"``, ``"softplus"`` or ``"softmax"``.
        beta: sharpness of ``"softplus"`` or inverse temperature of ``"softmax"``; default the form's.
        init_std: standard deviation of the initial ``xi``; default ``1/sqrt(D)``.
        dtype: dtype of ``xi``.
        device: device of ``xi``.

    Raises:
        ValueError: an unknown ``form``, or ``memories`` or ``beta`` not positive.
    """

    def __init__(
        self,
        dim: int,
        memories: int,
        *,
        form: HopfieldForm = "relu",
        beta: float | None = None,
        init_std: float | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if form not in HOPFIELD_FORMS:
            raise ValueError(f"hopfield form must be one of {HOPFIELD_FORMS}, got {form!r}")
        check_positive("memories", memories, integer=True)
        default = {"relu": 1.0, "softmax": 1.0, "softplus": 4.0}[form]
        beta = default if beta is None else float(beta)
        check_positive("beta_hn", beta)
        self.dim, self.memories, self.form, self.beta = dim, memories, form, beta
        std = init_std if init_std is not None else 1.0 / math.sqrt(dim)
        self.xi = nn.Parameter(torch.randn(memories, dim, dtype=dtype, device=device) * std)

    def energy(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``E_HN`` per sample: ``(..., N, D) -> (...)`` (each token alone: ``mask`` is not used).

        Args:
            g: activations ``(..., N, D)``.
            mask: the field's mask (not used).

        Returns:
            The energy per sample, ``(...)``.
        """
        h = nn.functional.linear(g, self.xi)  # g xi^T
        if self.form == "relu":
            return -0.5 * torch.relu(h).square().sum(dim=(-1, -2))
        if self.form == "softplus":
            r = softplus(self.beta * h) / self.beta
            return -0.5 * r.square().sum(dim=(-1, -2))
        return -torch.logsumexp(self.beta * h, dim=-1).sum(dim=-1) / self.beta

    def dE_dg(self, g: Tensor, mask: Mask = None) -> Tensor:
        """``dE_HN/dg`` in closed form: ``(..., N, D) -> (..., N, D)`` (``mask`` is not used).

        Args:
            g: activations ``(..., N, D)``.
            mask: the field's mask (not used).

        Returns:
            ``dE/dg``, ``(..., N, D)``.
        """
        h = nn.functional.linear(g, self.xi)  # g xi^T
        if self.form == "relu":
            coefficient = torch.relu(h)
        elif self.form == "softplus":
            coefficient = softplus(self.beta * h) / self.beta * torch.sigmoid(self.beta * h)
        else:
            coefficient = torch.softmax(self.beta * h, dim=-1)
        return -(coefficient @ self.xi)
