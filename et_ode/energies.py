"""Energies of the normalized tokens ``g``: each class holds one energy and its closed-form gradient.

Shapes: ``g`` is ``(..., N, D)``; energies are returned per sample, shape ``(...)``; gradients
``dE/dg`` have the shape of ``g``. Masks follow PyTorch's convention: ``mask[..., C, B]`` is True
where query token ``C`` may attend to key token ``B``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .graph_attention import GraphMask, graph_attention_weights, graph_energy, graph_energy_grad


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


class EnergyAttention(nn.Module):
    """Multi-head energy attention (SPEC section 2), no value matrix.

    ``E_ATT = -sum_h (1/beta_h) sum_C log sum_{B allowed for C} exp(beta_h K_hB . Q_hC)``

    Parameters ``WK``, ``WQ`` have the paper's layout ``(H, Y, D)``. By default a token does not
    attend to itself (``B != C``); ``self_attention=True`` includes the diagonal, as the official
    code releases do. A query token with no allowed key contributes nothing.

    ``beta`` (shape ``(H,)``) is a constant, not a weight: it stays float64 whatever dtype the module is
    moved to, so a float64 model holds ``1/sqrt(Y)`` exactly; it is rounded to the computation's dtype where used.
    """

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
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
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
        allowed = None if mask is None else mask.transpose(-1, -2)
        if not self.self_attention:
            off_diagonal = ~torch.eye(n, dtype=torch.bool, device=device)
            allowed = off_diagonal if allowed is None else allowed & off_diagonal
        return None if allowed is None else allowed.unsqueeze(-3)

    def _logits(self, g: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``beta_h A[h, B, C]`` with disallowed pairs at -inf (and fully masked queries at 0)."""
        k, q = self._keys_queries(g)
        beta = self.beta.to(g.dtype)[:, None, None]
        logits = beta * (k @ q.transpose(-1, -2))  # (..., H, B, C)
        allowed = self._allowed(g.shape[-2], mask, g.device)
        has_key = None
        if allowed is not None:
            has_key = allowed.any(dim=-2, keepdim=True)  # (..., 1, 1, C)
            logits = logits.masked_fill(~allowed, -math.inf).masked_fill(~has_key, 0.0)
        return logits, k, q, has_key

    def energy(self, g: Tensor, mask: Tensor | GraphMask | None = None) -> Tensor:
        """``E_ATT`` per sample: ``(..., N, D) -> (...)``. A :class:`GraphMask` uses the edge-list form."""
        if isinstance(mask, GraphMask):
            return graph_energy(self, g, mask)
        logits, _, _, has_key = self._logits(g, mask)
        lse = torch.logsumexp(logits, dim=-2)  # (..., H, C)
        if has_key is not None:
            lse = lse * has_key.squeeze(-2)
        return -(lse / self.beta.to(g.dtype)[:, None]).sum(dim=(-1, -2))

    def attention(self, g: Tensor, mask: Tensor | GraphMask | None = None) -> Tensor:
        """Attention weights ``S[..., h, B, C]``: softmax over keys ``B`` for each query ``C``.

        With a :class:`GraphMask`, the weights per edge ``(..., H, E)``, aligned with ``mask.edge_index``.
        """
        if isinstance(mask, GraphMask):
            return graph_attention_weights(self, g, mask)
        logits, _, _, has_key = self._logits(g, mask)
        weights = torch.softmax(logits, dim=-2)
        return weights if has_key is None else weights * has_key

    def dE_dg(self, g: Tensor, mask: Tensor | GraphMask | None = None) -> Tensor:
        """``dE_ATT/dg`` in closed form: ``(..., N, D) -> (..., N, D)``.

        ``-sum_h [S_h Q_h WK_h + S_h^T K_h WQ_h]``: token D as a key, then as a query.
        A :class:`GraphMask` uses the edge-list form (segment softmax over each query's incoming edges).
        """
        if isinstance(mask, GraphMask):
            return graph_energy_grad(self, g, mask)
        logits, k, q, has_key = self._logits(g, mask)
        weights = torch.softmax(logits, dim=-2)
        if has_key is not None:
            weights = weights * has_key
        d_keys = weights @ q  # (..., H, N, Y): sum_C S[B, C] Q[C]
        d_queries = weights.transpose(-1, -2) @ k  # sum_B S[B, C] K[B]
        both = torch.stack([d_keys, d_queries], dim=-4).movedim(-2, -4)  # (..., N, 2, H, Y)
        weight = torch.cat([self.WK, self.WQ], dim=0).reshape(-1, self.dim)
        return -(both.flatten(-3) @ weight)


HOPFIELD_FORMS = ("relu", "softmax", "softplus")


class HopfieldMemory(nn.Module):
    """Hopfield memories acting on each token alone (SPEC section 3).

    With overlaps ``h[B, mu] = xi_mu . g_B``:

    - ``"relu"`` (the paper): ``E = -1/2 sum relu(h)^2``. Its gradient has kinks where an overlap
      crosses zero, which limits how well adaptive solvers and their gradients converge.
    - ``"softplus"``: ``E = -1/2 sum r(h)^2`` with the smooth rectifier
      ``r(h) = softplus(s h) / s`` (``s = beta``, default 4): a C-infinity stand-in for ReLU.
    - ``"softmax"``: ``E = -(1/beta) sum_B log sum_mu exp(beta h[B, mu])`` (``beta`` default 1).
    """

    def __init__(self, dim: int, memories: int, *, form: str = "relu", beta: float | None = None,
                 init_std: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        if form not in HOPFIELD_FORMS:
            raise ValueError(f"hopfield form must be one of {HOPFIELD_FORMS}, got {form!r}")
        if not isinstance(memories, int) or memories < 1:
            raise ValueError(f"memories must be a positive integer, got {memories!r}")
        default = {"relu": 1.0, "softmax": 1.0, "softplus": 4.0}[form]
        beta = default if beta is None else float(beta)
        if not (beta > 0 and math.isfinite(beta)):
            raise ValueError(f"beta_hn must be positive and finite, got {beta!r}")
        self.dim, self.memories, self.form, self.beta = dim, memories, form, beta
        std = init_std if init_std is not None else 1.0 / math.sqrt(dim)
        self.xi = nn.Parameter(torch.randn(memories, dim, dtype=dtype, device=device) * std)

    def energy(self, g: Tensor) -> Tensor:
        """``E_HN`` per sample: ``(..., N, D) -> (...)``."""
        h = g @ self.xi.T
        if self.form == "relu":
            return -0.5 * torch.relu(h).square().sum(dim=(-1, -2))
        if self.form == "softplus":
            r = nn.functional.softplus(self.beta * h) / self.beta
            return -0.5 * r.square().sum(dim=(-1, -2))
        return -torch.logsumexp(self.beta * h, dim=-1).sum(dim=-1) / self.beta

    def dE_dg(self, g: Tensor) -> Tensor:
        """``dE_HN/dg`` in closed form: ``(..., N, D) -> (..., N, D)``."""
        h = g @ self.xi.T
        if self.form == "relu":
            coefficient = torch.relu(h)
        elif self.form == "softplus":
            coefficient = nn.functional.softplus(self.beta * h) / self.beta * torch.sigmoid(self.beta * h)
        else:
            coefficient = torch.softmax(self.beta * h, dim=-1)
        return -(coefficient @ self.xi)
