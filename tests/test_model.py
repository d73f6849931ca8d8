"""The EnergyTransformer's constructors, loading of external weights, and input validation."""

import pytest
import torch

from et_ode import EnergyTransformer, ETField
from et_ode.io import load_model, save_model
from tests.conftest import random_model


def test_from_tensors_holds_exactly_the_given_weights():
    torch.manual_seed(3)
    WK, WQ = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    xi, delta = torch.randn(10, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    model = EnergyTransformer.from_tensors(WK, WQ, xi, 0.37, delta, beta=0.5, hopfield="softmax", beta_hn=2.0)
    assert torch.equal(model.attention.WK, WK) and torch.equal(model.attention.WQ, WQ)
    assert torch.equal(model.hopfield.xi, xi) and torch.equal(model.neuron.delta, delta)
    assert abs(float(model.neuron.gamma.detach()) - 0.37) < 1e-14
    assert model.attention.beta.tolist() == [0.5, 0.5] and model.hopfield.beta == 2.0
    # the energy of these weights, written out with einsum in the paper's index layout
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    g = torch.nn.functional.layer_norm(x, (6,), eps=1e-5) * 0.37 + delta
    k = torch.einsum("hyj,bBj->bhyB", WK, g)
    q = torch.einsum("hyj,bCj->bhyC", WQ, g)
    a = torch.einsum("bhyB,bhyC->bhBC", k, q)
    off = ~torch.eye(5, dtype=torch.bool)
    lse = torch.logsumexp((0.5 * a).masked_fill(~off, float("-inf")), dim=2)
    e_att = -lse.sum(dim=(1, 2)) / 0.5
    e_hn = -torch.logsumexp(2.0 * g @ xi.T, dim=-1).sum(-1) / 2.0
    torch.testing.assert_close(model.energy(x), e_att + e_hn, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, tensors, word", [
    ("WK rank", dict(WK=torch.randn(3, 6)), "WK"),
    ("WQ shape", dict(WQ=torch.randn(2, 3, 5)), "WQ"),
    ("xi dim", dict(xi=torch.randn(10, 5)), "xi"),
    ("delta", dict(delta=torch.randn(5)), "delta"),
    ("gamma", dict(gamma=-1.0), "gamma"),
])
def test_from_tensors_rejects_bad_shapes(name, tensors, word):
    args = dict(WK=torch.randn(2, 3, 6), WQ=torch.randn(2, 3, 6), xi=torch.randn(10, 6), gamma=1.0, delta=torch.zeros(6))
    args.update(tensors)
    with pytest.raises(ValueError, match=word):
        EnergyTransformer.from_tensors(**args)


def test_bad_inputs_raise_errors_that_name_the_problem():
    model = random_model()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"D=8.*\(2, 5, 7\)"):
        model.energy(torch.randn(2, 5, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="non-finite"):
        model.energy(torch.where(torch.rand_like(x) > 0.5, x, torch.nan))
    with pytest.raises(TypeError, match="floating"):
        model.energy(torch.ones(2, 5, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.bool"):
        model.energy(x, torch.ones(5, 5))
    with pytest.raises(ValueError, match=r"N=5.*\(4, 4\)"):
        model.energy(x, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="broadcast"):
        model.energy(x, torch.ones(3, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="hopfield"):
        EnergyTransformer(8, 2, 4, 16, hopfield="tanh")
    with pytest.raises(ValueError, match="eps"):
        EnergyTransformer(8, 2, 4, 16, eps=0.0)
    with pytest.raises(ValueError, match="beta"):
        EnergyTransformer(8, 2, 4, 16, beta=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="tau"):
        ETField(model, tau=0.0)


def test_save_and_load_round_trip(tmp_path):
    model = random_model(hopfield="softplus", self_attention=True, beta=[0.3, 0.9])
    path = save_model(model, tmp_path / "m.pt", note="hello")
    loaded, meta = load_model(path)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    assert meta == {"note": "hello"}
    torch.testing.assert_close(loaded.energy(x), model.energy(x), rtol=0, atol=0)


def test_load_reports_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model file"):
        load_model(tmp_path / "absent.pt")
    path = save_model(random_model(), tmp_path / "m.pt")
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_model(path)
