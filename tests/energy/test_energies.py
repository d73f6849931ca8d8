"""Energies against naive loop implementations, and closed-form gradients against autograd."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from et_ode import EnergyTransformer, ETField
from tests.conftest import random_model


def naive_energy(model: EnergyTransformer, x: torch.Tensor, mask: torch.Tensor | None) -> float:
    """One sample, explicit Python loops over h, B, C and mu, straight from SPEC sections 1-3."""
    n, d = x.shape
    gamma, delta, eps = float(model.neuron.gamma.detach()), model.neuron.delta.tolist(), model.neuron.eps
    g = []
    for a in range(n):
        mean = sum(float(v) for v in x[a]) / d
        sigma = math.sqrt(sum((float(v) - mean) ** 2 for v in x[a]) / d + eps)
        g.append([gamma * (float(x[a, i]) - mean) / sigma + delta[i] for i in range(d)])
    att = model.attention
    energy = 0.0
    for h in range(att.heads):
        beta = float(att.beta[h])
        wk, wq = att.WK[h].tolist(), att.WQ[h].tolist()
        keys = [[sum(wk[al][j] * g[b][j] for j in range(d)) for al in range(att.head_dim)] for b in range(n)]
        queries = [[sum(wq[al][j] * g[c][j] for j in range(d)) for al in range(att.head_dim)] for c in range(n)]
        for c in range(n):
            terms = []
            for b in range(n):
                if b == c and not att.self_attention:
                    continue
                if mask is not None and not bool(mask[c, b]):
                    continue
                terms.append(math.exp(beta * sum(k * q for k, q in zip(keys[b], queries[c]))))
            if terms:
                energy -= math.log(sum(terms)) / beta
    hop = model.hopfield
    xi = hop.xi.tolist()
    for b in range(n):
        overlaps = [sum(xi[mu][j] * g[b][j] for j in range(d)) for mu in range(hop.memories)]
        if hop.form == "relu":
            energy -= 0.5 * sum(max(o, 0.0) ** 2 for o in overlaps)
        elif hop.form == "softplus":
            energy -= 0.5 * sum((math.log1p(math.exp(hop.beta * o)) / hop.beta) ** 2 for o in overlaps)
        else:
            energy -= math.log(sum(math.exp(hop.beta * o) for o in overlaps)) / hop.beta
    return energy


@pytest.mark.parametrize("hopfield", ["relu", "softmax", "softplus"])
@pytest.mark.parametrize("self_attention", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_energy_matches_naive_loops(hopfield, self_attention, masked):
    model = random_model(5, 2, 3, 4, hopfield=hopfield, self_attention=self_attention, beta=[0.7, 1.3])
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[:, 0] = False  # query 0 attends to nothing: it must contribute nothing
    energies = model.energy(x, mask)
    for i in range(2):
        expected = naive_energy(model, x[i], None if mask is None else mask[i])
        assert math.isclose(float(energies[i]), expected, rel_tol=1e-10, abs_tol=1e-10)


def test_energy_terms_sum_to_energy():
    model = random_model()
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    terms = model.energy_terms(x)
    torch.testing.assert_close(terms["attention"] + terms["hopfield"], model.energy(x))


def test_fully_masked_sample_has_zero_attention_energy_and_no_nan():
    model = random_model()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    g = model.activation(x).requires_grad_(True)
    terms = model.attention.energy(g, mask)
    assert torch.equal(terms, torch.zeros(2, dtype=torch.float64))
    (grad,) = torch.autograd.grad(model.energy_g(g, mask).sum(), g)
    assert torch.isfinite(grad).all()
    assert torch.equal(model.attention.dE_dg(g, mask), torch.zeros_like(g))


def autograd_grad(model: EnergyTransformer, g: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    g = g.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(model.energy_g(g, mask).sum(), g)
    return grad


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 6),
    d=st.integers(2, 9),
    heads=st.integers(1, 3),
    y=st.integers(1, 4),
    k=st.integers(1, 10),
    batch=st.integers(1, 3),
    hopfield=st.sampled_from(["relu", "softmax", "softplus"]),
    self_attention=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_closed_form_gradient_matches_autograd(n, d, heads, y, k, batch, hopfield, self_attention, masked, seed):
    model = random_model(d, heads, y, k, seed=seed, hopfield=hopfield, self_attention=self_attention)
    generator = torch.Generator().manual_seed(seed)
    g = model.activation(torch.randn(batch, n, d, dtype=torch.float64, generator=generator))
    mask = (torch.rand(batch, n, n, generator=generator) > 0.5) if masked else None
    closed = model.dE_dg(g, mask)
    reference = autograd_grad(model, g, mask)
    scale = reference.abs().max().clamp_min(1e-300)
    assert float((closed - reference).abs().max() / scale) < 1e-10


def test_gradient_batched_over_several_leading_dims():
    model = random_model()
    g = model.activation(torch.randn(2, 3, 5, 8, dtype=torch.float64))
    mask = torch.rand(3, 5, 5) > 0.3
    torch.testing.assert_close(model.dE_dg(g, mask), autograd_grad(model, g, mask), rtol=1e-10, atol=1e-12)
    assert model.energy_g(g, mask).shape == (2, 3)


def test_float32_gradient_close_to_float64():
    model64 = random_model(16, 2, 8, 32)
    model32 = copy.deepcopy(model64).float()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    g64, g32 = model64.activation(x), model32.activation(x.float())
    torch.testing.assert_close(model32.dE_dg(g32).double(), model64.dE_dg(g64), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    model = random_model()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.rand(5, 5) > 0.3
    expected = model.dE_dg(model.activation(x), mask)
    model_cuda = model.cuda()
    got = model_cuda.dE_dg(model_cuda.activation(x.cuda()), mask.cuda())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softplus_memory_is_exact_where_torch_switches_to_linear(dtype):
    # s h between 20 and 40: torch's default softplus returns s h there, 2e-9 from log(1 + e^(s h)); the energy and its
    # closed-form gradient must both follow the exact rectifier (logaddexp), or they disagree with each other
    model = random_model(4, 1, 2, 3, seed=0, hopfield="softplus", beta_hn=30.0).to(dtype)
    g = model.activation(torch.randn(2, 3, 4, dtype=dtype, generator=torch.Generator().manual_seed(1)))
    h = (g @ model.hopfield.xi.T).double()
    assert bool(((30.0 * h > 20) & (30.0 * h < 40)).any())  # the test reaches the switch
    rectified = torch.logaddexp(30.0 * h, torch.zeros((), dtype=torch.float64)) / 30.0
    energy = -0.5 * rectified.square().sum(dim=(-1, -2))
    gradient = -(rectified * torch.sigmoid(30.0 * h)) @ model.hopfield.xi.double()
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    assert torch.allclose(model.hopfield.energy(g).double(), energy, rtol=tol, atol=0)
    assert float((model.hopfield.dE_dg(g).double() - gradient).abs().max() / gradient.abs().max()) < tol
    field = ETField(model)
    assert float((field.dE_dg(g).double() - model.dE_dg(g).double()).abs().max() / gradient.abs().max()) < 10 * tol
