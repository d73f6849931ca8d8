"""The graph ET: tokens and mask of a batch, batching as one disjoint graph, sign flips, equivariance."""

import pytest
import torch

pytest.importorskip("torch_geometric")

from torch_geometric.data import Batch, Data  # noqa: E402

from et_ode import AttractorReadout, EulerET, Integration, find_attractor  # noqa: E402
from et_ode.data.graphs import add_laplacian_pe  # noqa: E402
from et_ode.models.graph import GraphET  # noqa: E402


def small_graph(n: int, seed: int, features: int = 3) -> Data:
    generator = torch.Generator().manual_seed(seed)
    nodes = torch.arange(n - 1)
    chain = torch.stack([nodes, nodes + 1])
    extra = torch.randint(0, n, (2, n), generator=generator)
    edges = torch.cat([chain, extra], dim=1)
    graph = Data(
        x=torch.randn(n, features, generator=generator),
        edge_index=torch.cat([edges, edges.flip(0)], 1),
        y=torch.tensor([seed % 2]),
    )
    return add_laplacian_pe(graph, 4)


def model(readout: str = "graph", **kwargs) -> GraphET:
    torch.manual_seed(0)
    return (
        GraphET(
            3,
            2,
            dim=8,
            heads=2,
            head_dim=4,
            memories=16,
            pe_dim=4,
            readout=readout,
            dynamics=Integration(solver=EulerET(0.1, 5)),
            **kwargs,
        )
        .double()
        .eval()
    )


def test_a_graph_model_reads_at_the_attractor_with_an_attractor_readout():
    """``dynamics=AttractorReadout()``: the logits are the head at the certified attractor of the batch's flow,
    found independently with ``find_attractor`` on the same tokens and mask."""
    torch.manual_seed(0)
    graph_model = GraphET(3, 2, dim=8, heads=2, head_dim=4, memories=16, pe_dim=4, dynamics=AttractorReadout()).double()
    batch = Batch.from_data_list([small_graph(5, 0), small_graph(6, 1)])
    with torch.no_grad():
        logits = graph_model.eval()(batch)
    assert graph_model.last_solution.stats.t_final == float("inf")
    x0, mask = graph_model.tokens(batch)
    found = find_attractor(graph_model.field.with_mask(mask), x0)
    assert found.status == ("certified",)
    torch.testing.assert_close(logits, graph_model.head(found.g[11:]).detach(), rtol=0, atol=1e-12)


def test_batch_mask_is_block_diagonal_adjacency_plus_cls_links():
    graphs = [small_graph(5, 0), small_graph(7, 1)]
    batch = Batch.from_data_list(graphs)
    tokens, mask = model().tokens(batch)
    assert tokens.shape == (5 + 7 + 2, 8)
    expected = torch.zeros(14, 14, dtype=torch.bool)
    expected[:5, :5][graphs[0].edge_index[1], graphs[0].edge_index[0]] = True
    expected[5:12, 5:12][graphs[1].edge_index[1], graphs[1].edge_index[0]] = True
    expected[12, :5] = expected[:5, 12] = True  # CLS 0 <-> nodes of graph 0
    expected[13, 5:12] = expected[5:12, 13] = True
    assert torch.equal(mask.to_dense(), expected)


@pytest.mark.parametrize("readout, pool", [("graph", "cls"), ("graph", "cls+mean"), ("graph", "cls+sum"), ("node", "cls")])
def test_a_batch_equals_its_graphs_one_by_one(readout, pool):
    graphs = [small_graph(n, seed) for seed, n in enumerate((4, 9, 6))]
    net = model(readout, pool=pool)
    with torch.no_grad():
        together = net(Batch.from_data_list(graphs))
        alone = torch.cat([net(Batch.from_data_list([graph])) for graph in graphs])
    assert together.shape == ((3, 2) if readout == "graph" else (19, 2))
    torch.testing.assert_close(together, alone, rtol=1e-10, atol=1e-12)


def test_node_readout_is_permutation_equivariant():
    graph = small_graph(8, 3)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    inverse = torch.argsort(perm)
    permuted = Data(x=graph.x[perm], pe=graph.pe[perm], edge_index=inverse[graph.edge_index])
    net = model("node")
    with torch.no_grad():
        torch.testing.assert_close(net(permuted), net(graph)[perm], rtol=1e-10, atol=1e-12)


def test_signs_of_the_encodings_flip_only_in_training():
    batch = Batch.from_data_list([small_graph(6, 0), small_graph(6, 1)])
    net = model()
    with torch.no_grad():
        assert torch.equal(net(batch), net(batch))
        net.train()
        torch.manual_seed(1)
        first = net(batch)
        second = net(batch)
        assert not torch.allclose(first, second)
        torch.manual_seed(2)
        trained = net(batch)
        torch.manual_seed(2)  # the same draw: one sign per graph and eigenvector
        sign = torch.randint(0, 2, (2, 4)).double() * 2 - 1
        flipped = batch.clone()
        flipped.pe = batch.pe * sign[batch.batch]
        net.eval()
        torch.testing.assert_close(net(flipped), trained, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(net(batch), trained)


def test_every_parameter_gets_a_gradient_and_errors_are_clear():
    batch = Batch.from_data_list([small_graph(5, 0), small_graph(6, 1)])
    net = model().train()
    torch.nn.functional.cross_entropy(net(batch), batch.y).backward()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None and bool(parameter.grad.abs().sum() > 0), name
    del batch.pe
    with pytest.raises(ValueError, match="add_laplacian_pe"):
        net(batch)
    with pytest.raises(ValueError, match="readout"):
        GraphET(3, 2, readout="edges")


@pytest.mark.parametrize("pool", ["cls+mean", "cls+sum"])
def test_pooled_readout_reads_the_cls_state_and_the_pooled_node_states(pool):
    graph = small_graph(6, 0)
    net = model(pool=pool)
    with torch.no_grad():
        logits = net(Batch.from_data_list([graph]))
        g = net.last_solution.g  # (6 nodes + 1 CLS, D)
        pooled = g[:6].mean(0) if pool == "cls+mean" else g[:6].sum(0)
        expected = net.head(torch.cat([g[6], pooled]))
    torch.testing.assert_close(logits[0], expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pool must be one of"):
        GraphET(3, 2, pool="max")
