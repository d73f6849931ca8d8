"""Attention masks, the one place that says which key a query may attend to. A leaf: imports only torch.

Two forms, accepted as ``mask=`` everywhere (``EnergyAttention``, ``EnergyTransformer``, ``ETField``, ``solve``):

- **dense**: a boolean tensor ``(N, N)`` or ``(*batch, N, N)``, PyTorch's convention: ``mask[..., C, B]`` is True
  where query token ``C`` may attend to key token ``B``. The attention logits are laid out ``(key B, query C)``;
  :func:`key_query` gives the mask in that layout.
- **edge list**: a :class:`GraphMask` holding ``edge_index`` of shape ``(2, E)``: edge ``(B, C)`` (row 0 the source
  ``B``, row 1 the target ``C``, PyTorch Geometric's source-to-target convention) lets query ``C`` attend to key
  ``B``. It is the sparse form of the dense mask with ``mask[C, B] = True``: memory O(E) instead of O(N^2).
  Every leading (batch) index of the tokens uses the same graph; a batch of graphs of different sizes is one
  disjoint graph (stack the nodes, offset each graph's edge indices by its first node, as PyG's ``Batch`` does).

``None`` allows every pair. Whether a token attends to itself is the energy's choice (``self_attention``), not the
mask's. Validation against the tokens: :func:`et_ode.energy.checks.check_mask`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from et_ode.backend.validation import check_positive


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
        check_positive("num_nodes", num_nodes, integer=True)
        bad = (edge_index < 0) | (edge_index >= num_nodes)
        if bool(bad.any()):
            row, column = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"edge_index[{row}, {column}] = {int(edge_index[row, column])} is out of range for "
                f"num_nodes={num_nodes} (valid indices 0..{num_nodes - 1})"
            )
        key = torch.unique(edge_index[1] * num_nodes + edge_index[0])  # sorted: by query, then key
        self.edge_index = torch.stack([key % num_nodes, key // num_nodes])
        self.num_nodes = num_nodes
        self._kept: dict[bool, Tensor] = {}

    @classmethod
    def from_dense(cls, mask: Tensor) -> GraphMask:
        """The edge list of a dense mask.

        Args:
            mask: boolean ``(N, N)``, ``mask[C, B]`` True where query ``C`` may attend to key ``B``.

        Returns:
            The :class:`GraphMask` of its ``E`` allowed pairs.

        Raises:
            ValueError: ``mask`` is not a boolean ``(N, N)`` tensor.
        """
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
        """This mask on ``device``.

        Args:
            device: the target device.

        Returns:
            The moved mask (``self`` when it is already there).
        """
        if torch.device(device) == self.device:
            return self
        moved = GraphMask.__new__(GraphMask)
        moved.edge_index, moved.num_nodes, moved._kept = self.edge_index.to(device), self.num_nodes, {}
        return moved

    def kept(self, self_attention: bool) -> Tensor:
        """Positions (into ``edge_index``) of the edges attention uses.

        Args:
            self_attention: whether self-loops count (all edges) or not (all but self-loops).

        Returns:
            The positions, ``(E',)`` int64.
        """
        if self_attention not in self._kept:
            if self_attention:
                self._kept[True] = torch.arange(self.num_edges, device=self.device)
            else:
                self._kept[False] = (self.edge_index[0] != self.edge_index[1]).nonzero().squeeze(-1)
        return self._kept[self_attention]

    def __repr__(self) -> str:
        return f"GraphMask(num_nodes={self.num_nodes}, num_edges={self.num_edges}, device={self.device})"


Mask = Tensor | GraphMask | None
"""What ``mask=`` takes: a dense boolean tensor, a :class:`GraphMask`, or None (every pair allowed)."""


def is_dense(mask: object) -> bool:
    """Whether ``mask`` is a dense mask: a strided boolean tensor (not a :class:`GraphMask`, not sparse)."""
    return type(mask) is Tensor and mask.dtype == torch.bool and mask.layout == torch.strided


def key_query(mask: Tensor) -> Tensor:
    """A dense ``mask[..., C, B]`` (query, key) in the layout of the attention logits: ``allowed[..., B, C]``."""
    return mask.transpose(-1, -2)
