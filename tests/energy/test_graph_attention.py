"""The edge-list attention equals the dense masked attention (float64), and works through field, solve and adjoint."""

import pytest
import torch

from et_ode import EnergyTransformer, ETField, Fixed, solve
from et_ode.energy.masks import GraphMask


def random_graph(n: int, edges: int, isolated: int, seed: int) -> GraphMask:
    """Random directed edges (with duplicates and self-loops) among the first ``n - isolated`` nodes."""
    generator = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n - isolated, (2, edges), generator=generator)
    edge_index = torch.cat([edge_index, torch.tensor([[0, 1, 1], [0, 1, 2]])], dim=1)  # self-loops, repeats
    return GraphMask(edge_index, n)


def model(self_attention: bool, seed: int = 0) -> EnergyTransformer:
    torch.manual_seed(seed)
    return EnergyTransformer(6, 3, 4, 10, self_attention=self_attention).double()


@pytest.mark.parametrize("self_attention", [False, True])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_sparse_equals_dense(self_attention, batch):
    mask = random_graph(15, 40, isolated=3, seed=len(batch))
    et = model(self_attention)
    g = et.neuron(torch.randn(*batch, 15, 6, dtype=torch.float64))
    dense = mask.to_dense()
    att = et.attention
    torch.testing.assert_close(att.energy(g, mask), att.energy(g, dense), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(att.dE_dg(g, mask), att.dE_dg(g, dense), rtol=1e-12, atol=1e-12)
    weights = att.attention(g, dense)[..., mask.edge_index[0], mask.edge_index[1]]  # (..., H, E)
    torch.testing.assert_close(att.attention(g, mask), weights, rtol=1e-12, atol=1e-12)
    assert att.dE_dg(g, mask)[..., 12:, :].abs().sum() == 0  # isolated nodes feel nothing from attention


def test_closed_form_gradient_matches_autograd_and_parameter_gradients_match_dense():
    mask = random_graph(20, 60, isolated=2, seed=3)
    et = model(False)
    g = et.neuron(torch.randn(2, 20, 6, dtype=torch.float64)).detach().requires_grad_(True)
    (auto,) = torch.autograd.grad(et.attention.energy(g, mask).sum(), g)
    torch.testing.assert_close(et.attention.dE_dg(g, mask), auto, rtol=1e-12, atol=1e-12)
    probe = torch.randn_like(g)
    for m in (mask, mask.to_dense()):  # d/dW of <grad, probe>: the training signal through the analytic field
        et.zero_grad()
        (et.attention.dE_dg(g, m) * probe).sum().backward()
        if m is mask:
            sparse_grads = [p.grad.clone() for p in (et.attention.WK, et.attention.WQ)]
    for sparse, p in zip(sparse_grads, (et.attention.WK, et.attention.WQ), strict=True):
        torch.testing.assert_close(sparse, p.grad, rtol=1e-10, atol=1e-12)


def test_only_self_loops_contribute_nothing_unless_self_attention():
    mask = GraphMask(torch.arange(4).repeat(2, 1), 4)
    g = model(False).neuron(torch.randn(4, 6, dtype=torch.float64))
    et = model(False)
    assert float(et.attention.energy(g, mask).detach()) == 0.0
    assert et.attention.dE_dg(g, mask).abs().max() == 0
    assert et.attention.attention(g, mask).abs().max() == 0
    et_self = model(True)
    torch.testing.assert_close(et_self.attention.energy(g, mask), et_self.attention.energy(g, mask.to_dense()))
    assert float(et_self.attention.energy(g, mask).detach()) != 0.0


def test_solve_and_adjoint_with_graph_mask_match_dense():
    mask = random_graph(10, 25, isolated=1, seed=5)
    et = model(False)
    x0 = torch.randn(2, 10, 6, dtype=torch.float64)
    results = {}
    for name, m in (("sparse", mask), ("dense", mask.to_dense())):
        for grad in ("direct", "adjoint"):
            et.zero_grad()
            sol = solve(ETField(et, mask=m), x0, (0.0, 1.0), solver=Fixed("rk4", step_size=0.05), gradient=grad)
            sol.g.square().sum().backward()
            results[name, grad] = (sol.g.detach(), sol.energies, et.attention.WK.grad.clone())
    reference = results["dense", "direct"]
    for key, value in results.items():
        torch.testing.assert_close(value[0], reference[0], rtol=1e-7, atol=1e-8, msg=str(key))
        torch.testing.assert_close(value[1], reference[1], rtol=1e-7, atol=1e-8, msg=str(key))
        torch.testing.assert_close(value[2], reference[2], rtol=1e-5, atol=1e-7, msg=str(key))
    assert bool((results["sparse", "direct"][1].diff(dim=0) <= 1e-9).all())  # energy decreases


def test_mask_round_trip_and_coalescing():
    edge_index = torch.tensor([[1, 1, 0, 2], [0, 0, 2, 2]])
    mask = GraphMask(edge_index, 3)
    assert mask.num_edges == 3  # the duplicate (1, 0) is merged
    assert mask.edge_index.tolist() == [[1, 0, 2], [0, 2, 2]]  # sorted by query, then key
    dense = torch.tensor([[False, True, False], [False, False, False], [True, False, True]])
    assert torch.equal(mask.to_dense(), dense)
    assert torch.equal(GraphMask.from_dense(dense).edge_index, mask.edge_index)


def test_bad_edge_lists_are_rejected_with_clear_errors():
    with pytest.raises(TypeError, match="torch.long"):
        GraphMask(torch.zeros(2, 3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"shape \(2, E\)"):
        GraphMask(torch.zeros(3, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"edge_index\[1, 2\] = 7 is out of range for num_nodes=4"):
        GraphMask(torch.tensor([[0, 1, 2], [1, 2, 7]]), 4)
    with pytest.raises(ValueError, match="out of range"):
        GraphMask(torch.tensor([[0, -1], [1, 2]]), 4)
    et = model(False)
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_nodes=4, but the tokens have N=5"):
        et.energy(x, GraphMask(torch.tensor([[0], [1]]), 4))
    with pytest.raises(TypeError, match="GraphMask"):
        et.energy(x, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="num_nodes=4"):
        solve(ETField(et, mask=GraphMask(torch.tensor([[0], [1]]), 4)), x, (0.0, 1.0))
