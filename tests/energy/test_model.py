"""The EnergyTransformer's constructors, loading of external weights, and input validation."""

import math

import pytest
import torch

from et_ode import EnergyTransformer, ETField
from et_ode.training.io import load_model, save_model
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


@pytest.mark.parametrize(
    "name, tensors, word",
    [
        ("WK rank", dict(WK=torch.randn(3, 6)), "WK"),
        ("WQ shape", dict(WQ=torch.randn(2, 3, 5)), "WQ"),
        ("xi dim", dict(xi=torch.randn(10, 5)), "xi"),
        ("delta", dict(delta=torch.randn(5)), "delta"),
        ("gamma", dict(gamma=-1.0), "gamma"),
    ],
)
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


def _reference_energy(g: torch.Tensor, model: EnergyTransformer, beta: float, beta_hn: float) -> torch.Tensor:
    """SPEC sections 2-3 in plain torch, with the constants given as Python floats (float64-exact)."""
    wk, wq, xi = (t.detach() for t in (model.attention.WK, model.attention.WQ, model.hopfield.xi))
    keys = torch.einsum("hyd,...bd->...hby", wk, g)
    queries = torch.einsum("hyd,...cd->...hcy", wq, g)
    scores = beta * torch.einsum("...hby,...hcy->...hbc", keys, queries)
    n = g.shape[-2]
    scores = scores.masked_fill(torch.eye(n, dtype=torch.bool), -math.inf)  # B != C
    attention = -(torch.logsumexp(scores, dim=-2) / beta).sum(dim=(-1, -2))
    hopfield = -(torch.logsumexp(beta_hn * g @ xi.T, dim=-1) / beta_hn).sum(dim=-1)
    return attention + hopfield


@pytest.mark.parametrize("build", ["double", "dtype", "from_tensors"])
def test_float64_models_hold_float64_constants_exactly(build):
    """beta = 1/sqrt(8) is not a float32 number: a float64 model must hold it (and beta_hn, eps) exactly, so that
    its energy and gradient equal a float64 computation to 1e-12, not to the 1e-8 of float32-rounded constants."""
    beta, beta_hn, eps = 1 / math.sqrt(8), 0.7, 1e-5
    options = dict(hopfield="softmax", beta_hn=beta_hn, eps=eps)
    torch.manual_seed(0)
    if build == "double":
        model = EnergyTransformer(16, 2, 8, 32, **options).double()
    elif build == "dtype":
        model = EnergyTransformer(16, 2, 8, 32, **options, dtype=torch.float64)
    else:
        w = torch.randn(3, 2, 8, 16, dtype=torch.float64) / 4
        model = EnergyTransformer.from_tensors(
            w[0],
            w[1],
            torch.randn(32, 16, dtype=torch.float64) / 4,
            0.9,
            torch.zeros(16, dtype=torch.float64),
            beta=beta,
            **options,
        )
    assert model.attention.beta.dtype == torch.float64
    assert model.attention.beta.tolist() == [beta, beta]
    assert model.hopfield.beta == beta_hn and model.neuron.eps == eps
    g = model.neuron(torch.randn(3, 7, 16, dtype=torch.float64)).detach().requires_grad_(True)
    expected = _reference_energy(g, model, beta, beta_hn)
    (expected_grad,) = torch.autograd.grad(expected.sum(), g)
    with torch.no_grad():
        energy, grad = model.energy_g(g), model.dE_dg(g)
        field = ETField(model, tau=2.0)  # the default (fused) field: -tau * f = dE/dg
        fused_grad = field.fused(g, None)
    torch.testing.assert_close(energy, expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fused_grad, expected_grad, rtol=1e-12, atol=1e-14)
