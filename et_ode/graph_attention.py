"""Energy attention restricted to a graph given as an edge list: O(E) memory instead of O(N^2).

A :class:`GraphMask` holds ``edge_index`` of shape ``(2, E)``: edge ``(B, C)`` (row 0 the source ``B``,
row 1 the target ``C``, PyTorch Geometric's source-to-target convention) lets query ``C`` attend to key ``B``.
It is the sparse form of the dense mask with ``mask[C, B] = True``, and ``EnergyAttention.energy``, ``grad``
and ``attention`` (so ``EnergyTransformer``, ``ETField``, ``solve`` and the adjoint) accept it as ``mask=``.

With ``P(C)`` the keys ``B`` of query ``C`` (self-loops ``B = C`` dropped unless ``self_attention``):

    E_ATT = -sum_h (1/beta_h) sum_{C: P(C) nonempty} log sum_{B in P(C)} exp(beta_h K_hB . Q_hC)
    dE_ATT/dg_D = -sum_h [ sum_{C: D in P(C)} S_h(D, C) WK_h^T Q_hC + sum_{B in P(D)} S_h(B, D) WQ_h^T K_hB ]

where ``S_h(B, C)`` is a segment softmax of the edge logits ``beta_h K_hB . Q_hC`` over the incoming edges
of each query ``C``. A query with no allowed key contributes nothing, as in the dense form.

Shapes: tokens ``g`` are ``(*batch, N, D)`` and every leading (batch) index uses the same graph. A batch of
graphs of different sizes is one disjoint graph: stack the nodes of all graphs into ``(N_total, D)`` (or
``(1, N_total, D)``) and offset each graph's edge indices by its first node (what PyG's ``Batch`` does);
energies are then the sum over the graphs. Memory is O(N H Y + E H Y).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .energies import EnergyAttention


class GraphMask:
    """An attention mask as a coalesced edge list (sorted by query, then key; duplicates removed).

    Args:
        edge_index: long tensor ``(2, E)``; column ``(B, C)`` means query ``C`` may attend to key ``B``.
        num_nodes: number of tokens ``N``; every index must lie in ``[0, N)``.

    Raises:
        TypeError: ``edge_index`` is not an integer (long) tensor.
        ValueError: wrong shape, ``num_nodes`` not positive, or an index out of range (the first one is named).
    """

    def __init__(self, edge_index: Tensor, num_nodes: int):
        if not isinstance(edge_index, Tensor):
            raise TypeError(f"edge_index must be a torch.Tensor of shape (2, E), got {type(edge_index).__name__}")
        if edge_index.dtype != torch.long:
            raise TypeError(f"edge_index must have dtype torch.long (int64), got {edge_index.dtype}")
        if edge_index.dim() != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must have shape (2, E), got shape {tuple(edge_index.shape)}")
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
        bad = (edge_index < 0) | (edge_index >= num_nodes)
        if bool(bad.any()):
            row, column = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"edge_index[{row}, {column}] = {int(edge_index[row, column])} is out of range for "
                             f"num_nodes={num_nodes} (valid indices 0..{num_nodes - 1})")
        key = torch.unique(edge_index[1] * num_nodes + edge_index[0])  # sorted: by query, then key
        self.edge_index = torch.stack([key % num_nodes, key // num_nodes])
        self.num_nodes = num_nodes
        self._kept: dict[bool, Tensor] = {}

    @classmethod
    def from_dense(cls, mask: Tensor) -> GraphMask:
        """The edge list of a boolean ``(N, N)`` mask (``mask[C, B]`` True where query ``C`` may attend to key ``B``)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a boolean (N, N) tensor, got {shape}")
        query, key = mask.nonzero().T
        return cls(torch.stack([key, query]), mask.shape[0])

    def to_dense(self) -> Tensor:
        """The boolean ``(N, N)`` mask, ``mask[C, B]`` True for every edge ``(B, C)``."""
        dense = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool, device=self.device)
        dense[self.edge_index[1], self.edge_index[0]] = True
        return dense

    @property
    def num_edges(self) -> int:
        return self.edge_index.shape[1]

    @property
    def device(self) -> torch.device:
        return self.edge_index.device

    def to(self, device: torch.device | str) -> GraphMask:
        """This mask on ``device`` (``self`` when it is already there)."""
        if torch.device(device) == self.device:
            return self
        moved = GraphMask.__new__(GraphMask)
        moved.edge_index, moved.num_nodes, moved._kept = self.edge_index.to(device), self.num_nodes, {}
        return moved

    def kept(self, self_attention: bool) -> Tensor:
        """Positions (into ``edge_index``) of the edges attention uses: all, or all but self-loops."""
        if self_attention not in self._kept:
            if self_attention:
                self._kept[True] = torch.arange(self.num_edges, device=self.device)
            else:
                self._kept[False] = (self.edge_index[0] != self.edge_index[1]).nonzero().squeeze(-1)
        return self._kept[self_attention]

    def __repr__(self) -> str:
        return f"GraphMask(num_nodes={self.num_nodes}, num_edges={self.num_edges}, device={self.device})"


def _edge_terms(attention: EnergyAttention, g: Tensor, mask: GraphMask) -> dict[str, Tensor]:
    """Per-node keys/queries ``(..., N, H, Y)``, their per-edge gathers ``(..., E', H, Y)`` and the segment
    softmax ``S (..., E', H)`` with ``logsumexp (..., N, H)`` over each query's incoming edges."""
    h, y, d, n = attention.heads, attention.head_dim, attention.dim, mask.num_nodes
    kept = mask.kept(attention.self_attention)
    src, dst = mask.edge_index[0, kept], mask.edge_index[1, kept]
    weight = torch.cat([attention.WK, attention.WQ], dim=0).reshape(2 * h * y, d)
    kq = (g @ weight.T).unflatten(-1, (2, h, y))  # (..., N, 2, H, Y)
    k, q = kq[..., 0, :, :], kq[..., 1, :, :]
    k_src, q_dst = k.index_select(-3, src), q.index_select(-3, dst)  # (..., E', H, Y)
    logits = attention.beta.to(g.dtype) * torch.linalg.vecdot(k_src, q_dst)  # (..., E', H)
    segment = dst.reshape(-1, 1).expand(logits.shape)
    peak = logits.new_full((*logits.shape[:-2], n, h), -torch.inf)
    peak = peak.scatter_reduce(-2, segment, logits.detach(), reduce="amax").detach()  # a stabilizer only
    exp = torch.exp(logits - peak.index_select(-2, dst))
    total = logits.new_zeros(peak.shape).index_add(-2, dst, exp)  # (..., N, H)
    weights = exp / total.index_select(-2, dst)
    return dict(k=k, q=q, k_src=k_src, q_dst=q_dst, weights=weights, peak=peak, total=total, src=src, dst=dst,
                kept=kept, weight=weight)


def graph_energy(attention: EnergyAttention, g: Tensor, mask: GraphMask) -> Tensor:
    """``E_ATT`` per sample on the graph: ``(..., N, D) -> (...)``."""
    terms = _edge_terms(attention, g, mask)
    has_key = torch.zeros(mask.num_nodes, dtype=torch.bool, device=g.device)
    has_key[terms["dst"]] = True
    lse = (terms["peak"][..., has_key, :] + torch.log(terms["total"][..., has_key, :]))  # (..., N', H)
    return -(lse / attention.beta.to(g.dtype)).sum(dim=(-1, -2))


def graph_attention_weights(attention: EnergyAttention, g: Tensor, mask: GraphMask) -> Tensor:
    """Attention weights per edge, ``(..., H, E)``, aligned with ``mask.edge_index`` (the sparse form of
    ``S[..., h, B, C]``); excluded self-loops get weight 0."""
    terms = _edge_terms(attention, g, mask)
    weights = terms["weights"]
    full = weights.new_zeros((*weights.shape[:-2], mask.num_edges, attention.heads))
    full = full.index_copy(-2, terms["kept"], weights)
    return full.movedim(-1, -2)


def graph_energy_grad(attention: EnergyAttention, g: Tensor, mask: GraphMask) -> Tensor:
    """``dE_ATT/dg`` on the graph in closed form: ``(..., N, D) -> (..., N, D)``."""
    terms = _edge_terms(attention, g, mask)
    s = terms["weights"].unsqueeze(-1)  # (..., E', H, 1)
    d_keys = torch.zeros_like(terms["k"]).index_add(-3, terms["src"], s * terms["q_dst"])  # node as a key
    d_queries = torch.zeros_like(terms["q"]).index_add(-3, terms["dst"], s * terms["k_src"])  # node as a query
    both = torch.stack([d_keys, d_queries], dim=-3)  # (..., N, 2, H, Y)
    return -(both.flatten(-3) @ terms["weight"])
