"""The vector field: analytic vs autograd, dE/dt, and energy descent under explicit Euler."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from et_ode import ETField, GraphMask
from tests.conftest import random_model


@pytest.mark.parametrize("hopfield", ["relu", "softmax"])
def test_analytic_field_equals_autograd_field(hopfield):
    model = random_model(hopfield=hopfield)
    mask = torch.rand(3, 6, 6) > 0.4
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    analytic, reference = ETField(model, tau=0.7, mask=mask), ETField(model, tau=0.7, derivative="autograd", mask=mask)
    torch.testing.assert_close(analytic(0.0, x), reference(0.0, x), rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # how odeint_adjoint calls the field
        torch.testing.assert_close(analytic(0.0, x), reference(0.0, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "tau, dtype, derivative",
    [
        (1.0, torch.float32, "analytic"),
        (1.0, torch.float64, "analytic"),
        (0.7, torch.float64, "analytic"),
        (0.7, torch.float64, "autograd"),
    ],
)
def test_the_velocity_written_into_out(tau, dtype, derivative):
    """``velocity(x, out=...)`` and ``field(t, x, out=...)`` write ``dx/dt`` into ``out`` and return it: the same bits
    as a new tensor, in a contiguous block (the fused product writes it) or in a strided view (one stage of a
    stage-major store), with a mask per sample; an ``out`` of another shape or dtype, or one asked for while
    gradients are recorded, is a ValueError naming it."""
    model = random_model(dtype=dtype)
    mask = torch.rand(3, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    field = ETField(model, tau=tau, derivative=derivative, mask=mask)
    x = torch.randn(3, 6, 8, dtype=dtype, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = field.velocity(x)
        block = torch.full_like(x, float("nan"))
        assert field.velocity(x, out=block) is block
        assert torch.equal(block, expected)
        store = torch.full((2, 3, 6, 8), float("nan"), dtype=dtype)
        stage = store.transpose(0, 1)[:, 1]  # (3, 6, 8), every sample's block 2 * 48 apart
        before = field.nfe
        assert field(None, x, out=stage) is stage and field.nfe == before + 1
        assert torch.equal(stage, expected) and bool(store[0].isnan().all())
        for bad in (torch.empty(3, 6, 7, dtype=dtype), torch.empty(3, 6, 8, dtype=torch.float16)):
            with pytest.raises(ValueError, match="out must have"):
                field.velocity(x, out=bad)
    with pytest.raises(ValueError, match="torch.no_grad"):
        field.velocity(x, out=block)


def test_select_gives_the_field_of_some_samples():
    """``select(index)`` of a field with one mask per sample evaluates each chosen sample with its own mask (checked
    against the model's energy and dE/dg with that mask alone); a shared mask is kept; the counter is shared."""
    model = random_model()
    masks = torch.rand(4, 6, 6) > 0.4
    x = torch.randn(4, 6, 8, dtype=torch.float64)
    field = ETField(model, tau=0.7, mask=masks)
    index = torch.tensor([3, 1])
    chosen = field.select(index)
    assert chosen.mask.shape == (2, 6, 6)
    for row, sample in enumerate(index.tolist()):
        g = model.neuron(x[sample])
        expected_energy = model.energy_g(g, masks[sample])
        torch.testing.assert_close(chosen.energy(x[index])[row], expected_energy, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(chosen.velocity(x[index])[row], -model.dE_dg(g, masks[sample]) / 0.7)
    torch.testing.assert_close(field.select(2).energy(x[2]), model.energy_g(model.neuron(x[2]), masks[2]))
    chosen(0.0, x[index])
    assert field.nfe == 1  # one evaluation, counted once, on the shared counter
    shared = masks[0]
    graph = GraphMask(torch.tensor([[0, 1, 2], [1, 2, 0]]), 6)
    for mask in (None, shared, graph):
        kept = ETField(model, mask=mask).select(index)
        assert kept.mask is mask


def test_autograd_field_is_differentiable_in_parameters():
    model = random_model()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    grads = []
    for mode in ("analytic", "autograd"):
        model.zero_grad()
        ETField(model, derivative=mode)(0.0, x).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-11)


def test_nfe_counts_and_resets():
    field = ETField(random_model())
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    for _ in range(3):
        field(0.0, x)
    assert field.nfe == 3
    bound = field.with_mask(torch.ones(3, 3, dtype=torch.bool))
    bound(0.0, x)
    assert field.nfe == 4 and bound.mask is not None and field.mask is None
    field.reset_nfe()
    assert field.nfe == 0


def test_dg_dt_is_the_time_derivative_of_g():
    model = random_model()
    field = ETField(model, tau=1.3)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    h = 1e-6
    velocity = field(0.0, x)
    fd = (model.activation(x + h * velocity) - model.activation(x - h * velocity)) / (2 * h)
    torch.testing.assert_close(field.dg_dt(x), fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("hopfield", ["relu", "softmax"])
def test_exact_dE_dt_matches_central_difference_along_the_flow(hopfield):
    model = random_model(hopfield=hopfield, seed=4)
    field = ETField(model, tau=0.5)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    h = 1e-6
    velocity = field(0.0, x)
    fd = (model.energy(x + h * velocity) - model.energy(x - h * velocity)) / (2 * h)
    exact = field.dE_dt(x)
    torch.testing.assert_close(exact, fd.detach(), rtol=1e-6, atol=1e-6)
    assert bool((exact <= 0).all())
    # the diagnostics' hot path: dE/dt from the velocity already computed at x
    torch.testing.assert_close(field.dE_dt(x, velocity.detach()), fd.detach(), rtol=1e-6, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    hopfield=st.sampled_from(["relu", "softmax", "softplus"]),
    self_attention=st.booleans(),
    n=st.integers(2, 6),
)
def test_small_euler_steps_never_raise_the_energy(seed, hopfield, self_attention, n):
    model = random_model(seed=seed, hopfield=hopfield, self_attention=self_attention)
    field = ETField(model)
    x = torch.randn(2, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    energies = []
    with torch.no_grad():
        for _ in range(300):
            energies.append(model.energy(x))
            x = x + 1e-3 * field(0.0, x)
    energies = torch.stack(energies)
    rises = energies[1:] - energies[:-1]
    assert float(rises.max()) <= 1e-10 * float(energies.abs().max())
    # bounded below: |g - delta| < gamma sqrt(D) bounds every overlap, hence the energy
    gamma, dim = float(model.neuron.gamma), model.dim
    radius = gamma * dim**0.5 + float(model.neuron.delta.norm())
    att = model.attention
    bound_att = (
        sum(
            float(att.WK[h].norm(2) * att.WQ[h].norm(2)) * radius**2 + float(torch.log(torch.tensor(n))) / float(att.beta[h])
            for h in range(att.heads)
        )
        * n
    )
    xi_norm = float(model.hopfield.xi.norm(dim=1).max())
    bound_hn = n * model.hopfield.memories * (xi_norm * radius) ** 2
    assert float(energies.min()) >= -(bound_att + bound_hn)
