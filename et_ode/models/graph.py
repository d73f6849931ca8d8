"""The Energy Transformer on graphs: nodes are tokens, attention follows the edges.

Tokens: ``x0_A = W_x x_A + W_pe (s * pe_A)`` for each node ``A``, with ``pe`` the ``k`` Laplacian eigenvectors
(:func:`et_ode.data.graphs.add_laplacian_pe`) and ``s`` a random sign per graph and eigenvector while training
(eigenvectors are defined up to sign). For graph readout a learned CLS token per graph is linked to every node of
its graph in both directions. Attention is restricted to the edges (plus the CLS links) with a
:class:`~et_ode.energy.masks.GraphMask`, so memory grows with the number of edges, not nodes squared.

A batch of graphs of different sizes (a PyG ``Batch``) is one disjoint graph: the state has shape
``(N_total + G, D)`` (the ``N_total`` nodes of all graphs, then one CLS token per graph), and ``solve`` integrates
the dynamics of all graphs at once (its step control and a steady-state stop see them as one sample).
The output is read from the final normalized state ``g``: the CLS tokens' (``readout="graph"``, logits
``(G, classes)``) or every node's (``readout="node"``, logits ``(N_total, classes)``).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from et_ode.backend.validation import check_positive
from et_ode.dynamics.field import ETField
from et_ode.energy.energies import HopfieldForm
from et_ode.energy.masks import GraphMask
from et_ode.energy.model import EnergyTransformer
from et_ode.integrators.solution import Solution
from et_ode.integrators.solvers import EulerET
from et_ode.models.image import check_model_size
from et_ode.solving.gradients import Direct
from et_ode.solving.integration import Dynamics, Integration, check_dynamics, settings_to_dict

Readout = Literal["graph", "node"]
Pool = Literal["cls", "cls+mean", "cls+sum"]
READOUTS: tuple[Readout, ...] = get_args(Readout)
POOLS: tuple[Pool, ...] = get_args(Pool)
# the paper's graph block: 12 Euler steps of 0.1, gradients straight through
PAPER_INTEGRATION = Integration(solver=EulerET(0.1, 12), gradient=Direct())


class GraphET(nn.Module):
    """Graph Energy Transformer.

    Args:
        in_features: node feature size ``F``.
        classes: outputs per graph (``readout="graph"``) or per node (``readout="node"``).
        dim, heads, head_dim, memories: the ET block (``D``, ``H``, ``Y``, ``K``).
        pe_dim: Laplacian eigenvectors per node ``k`` (0: none).
        readout: ``"graph"`` (CLS tokens) or ``"node"`` (no CLS token).
        hopfield, self_attention: passed to :class:`~et_ode.EnergyTransformer`.
        dynamics: how the block runs: an :class:`~et_ode.Integration` (default the paper's block,
            ``EulerET(alpha=0.1, steps=12)`` with ``Direct()`` gradients; any other solver runs on ``(0, t1)``) or an
            :class:`~et_ode.AttractorReadout` (the answer read at the certified attractor of the flow).
        dropout: dropout on the encoded node features while training.
        tau: the field's time constant.
        head_hidden: 0 for a linear read-out of ``g``; else a hidden layer of this width (GELU) before it.
        pool: graph read-out: the CLS token's ``g`` (``"cls"``, the paper's), or that concatenated with the mean
            (``"cls+mean"``) or the sum (``"cls+sum"``, which keeps the graph's size) of its nodes' ``g``.

    ``forward(batch)`` takes a PyG ``Data``/``Batch`` with ``x (N, F)``, ``edge_index (2, E)``, ``pe (N, k)`` and,
    for several graphs, ``batch (N,)``; it returns logits.
    """

    def __init__(
        self,
        in_features: int,
        classes: int,
        *,
        dim: int = 64,
        heads: int = 4,
        head_dim: int = 16,
        memories: int = 128,
        pe_dim: int = 15,
        readout: Readout = "graph",
        hopfield: HopfieldForm = "relu",
        self_attention: bool = False,
        dynamics: Dynamics = PAPER_INTEGRATION,
        dropout: float = 0.0,
        tau: float = 1.0,
        head_hidden: int = 0,
        pool: Pool = "cls",
    ):
        super().__init__()
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        for name, value in (("in_features", in_features), ("classes", classes)):
            check_positive(name, value, integer=True)
        if not (isinstance(pe_dim, int) and pe_dim >= 0):
            raise ValueError(f"pe_dim must be an integer >= 0, got {pe_dim!r}")
        if isinstance(dim, int) and not isinstance(dim, bool):
            extra = (in_features + pe_dim + 2 * classes + 3) * dim + 2 * dim * max(head_hidden, 0)
        else:
            extra = 0
        check_model_size(dim, heads, head_dim, memories, extra)
        self.dynamics = check_dynamics("dynamics", dynamics)
        self.config: dict[str, Any] = dict(
            in_features=in_features,
            classes=classes,
            dim=dim,
            heads=heads,
            head_dim=head_dim,
            memories=memories,
            pe_dim=pe_dim,
            readout=readout,
            hopfield=hopfield,
            self_attention=self_attention,
            dynamics=settings_to_dict(dynamics),
            dropout=dropout,
            tau=tau,
            head_hidden=head_hidden,
            pool=pool,
        )
        self.readout, self.pe_dim, self.pool = readout, pe_dim, pool
        self.encoder = nn.Linear(in_features, dim)
        self.pe_encoder = nn.Linear(pe_dim, dim, bias=False) if pe_dim else None
        self.cls = nn.Parameter(torch.randn(dim) * 0.02) if readout == "graph" else None
        self.dropout = nn.Dropout(dropout)
        self.et = EnergyTransformer(dim, heads, head_dim, memories, hopfield=hopfield, self_attention=self_attention)
        self.field = ETField(self.et, tau=tau)
        width = dim if readout == "node" or pool == "cls" else 2 * dim
        self.head = (
            nn.Linear(width, classes)
            if not head_hidden
            else nn.Sequential(nn.Linear(width, head_hidden), nn.GELU(), nn.Linear(head_hidden, classes))
        )
        self.last_solution: Solution | None = None

    def tokens(self, batch: Any) -> tuple[Tensor, GraphMask]:
        """The initial state ``(N + G, D)`` (``(N, D)`` for node readout) and its attention mask.

        Args:
            batch: a PyG ``Data``/``Batch`` with ``x (N, F)``, ``edge_index (2, E)``, ``pe (N, k)`` when
                ``pe_dim > 0`` and, for several graphs, ``batch (N,)``.

        Returns:
            The node tokens followed by one CLS token per graph ``(N + G, D)`` (``(N, D)`` for node readout), and
            the attention mask: the graph's edges, plus links between each node and its graph's CLS token.

        Raises:
            ValueError: ``batch.x`` is not ``(N, F)``, or ``batch.pe`` is missing or not ``(N, k)``.
        """
        x, edge_index = batch.x, batch.edge_index
        n = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.encoder.in_features:
            raise ValueError(f"batch.x must have shape (N, {self.encoder.in_features}), got {tuple(x.shape)}")
        graph_of = getattr(batch, "batch", None)
        if graph_of is None:
            graph_of = torch.zeros(n, dtype=torch.long, device=x.device)
        graphs = int(graph_of.max()) + 1 if n else 0
        tokens = self.dropout(self.encoder(x.to(self.encoder.weight.dtype)))
        if self.pe_encoder is not None:
            pe = getattr(batch, "pe", None)
            if pe is None or tuple(pe.shape) != (n, self.pe_dim):
                shape = None if pe is None else tuple(pe.shape)
                raise ValueError(
                    f"batch.pe must have shape (N, pe_dim) = ({n}, {self.pe_dim}), got {shape}; "
                    f"add it with et_ode.data.graphs.add_laplacian_pe(data, k={self.pe_dim})"
                )
            pe = pe.to(tokens.dtype)
            if self.training:  # eigenvectors have no preferred sign: a random one per graph and eigenvector
                sign = torch.randint(0, 2, (graphs, self.pe_dim), device=x.device).to(pe.dtype) * 2 - 1
                pe = pe * sign[graph_of]
            tokens = tokens + self.pe_encoder(pe)
        if self.cls is None:
            return tokens, GraphMask(edge_index, n)
        cls_index = n + torch.arange(graphs, device=x.device)
        nodes = torch.arange(n, device=x.device)
        links = torch.cat([torch.stack([nodes, cls_index[graph_of]]), torch.stack([cls_index[graph_of], nodes])], 1)
        tokens = torch.cat([tokens, self.cls.expand(graphs, -1)])
        return tokens, GraphMask(torch.cat([edge_index, links], dim=1), n + graphs)

    def forward(self, batch: Any) -> Tensor:
        """Logits ``(G, classes)`` (graph readout) or ``(N, classes)`` (node readout).

        Args:
            batch: a PyG ``Data``/``Batch`` as :meth:`tokens` takes it.

        Returns:
            The logits ``(G, classes)`` or ``(N, classes)``.

        Raises:
            ValueError: ``batch.x`` or ``batch.pe`` of the wrong shape.
            et_ode.SolveError: the integration cannot go on.
        """
        x0, mask = self.tokens(batch)
        solution = self.dynamics.answer(self.field.with_mask(mask), x0)
        self.last_solution = solution
        if self.cls is None:
            return self.head(solution.g)
        n = batch.x.shape[0]
        g = solution.g[n:]
        if self.pool != "cls":
            graph_of = getattr(batch, "batch", None)
            if graph_of is None:
                graph_of = torch.zeros(n, dtype=torch.long, device=g.device)
            pooled = g.new_zeros(g.shape).index_add(0, graph_of, solution.g[:n])
            if self.pool == "cls+mean":
                pooled = pooled / torch.bincount(graph_of, minlength=g.shape[0]).clamp_min(1).unsqueeze(-1).to(g.dtype)
            g = torch.cat([g, pooled], dim=-1)
        return self.head(g)
