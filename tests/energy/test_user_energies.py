"""The public energy interface: a user's neuron and interaction, written as docs/guides/own-energy.md writes them, run
through the field and ``solve`` with every gradient, against finite differences, closed forms and dense Hessians in
float64; the ET built from the same public parts; the refusals that name their argument."""

from __future__ import annotations

import math

import pytest
import torch

import et_ode
from et_ode.energy.neurons import GEOMETRIES, sphere_neuron
from tests.conftest import random_model


# -- the docs' energy (docs/guides/own-energy.md, "A dense associative memory in a dozen lines"), copied -------------
class DenseMemory(et_ode.Interaction):
    """E(g) = -(1/beta) sum_A log sum_mu exp(-beta |g_A - xi_mu|^2 / 2): a dense associative memory."""

    def __init__(self, patterns: torch.Tensor, beta: float):
        super().__init__()
        self.xi = torch.nn.Parameter(patterns)
        self.beta = beta

    def energy(self, g: torch.Tensor, mask=None) -> torch.Tensor:
        distances = (g[..., None, :] - self.xi).square().sum(dim=-1)  # (..., N, K)
        return -(torch.logsumexp(-0.5 * self.beta * distances, dim=-1) / self.beta).sum(dim=-1)


# -- the docs' neuron (docs/guides/own-energy.md, "A neuron of your own"), copied --------------------------------------
class SigmoidNeuron(et_ode.Neuron):
    """L(x) = sum_i log(1 + exp(x_i)): g = sigmoid(x) and M = diag(g (1 - g)), by torch.func."""

    def lagrangian(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(x).sum(dim=-1)


def docs_model(seed: int = 0) -> tuple[et_ode.EnergyModel, torch.Tensor]:
    torch.manual_seed(seed)
    patterns = 2.0 * torch.randn(5, 2, dtype=torch.float64)
    model = et_ode.EnergyModel(et_ode.IdentityNeuron(2), {"memory": DenseMemory(patterns, beta=4.0)})
    return model, torch.randn(3, 4, 2, dtype=torch.float64)


def closed_form_dE_dg(memory: DenseMemory, g: torch.Tensor) -> torch.Tensor:
    """``sum_mu softmax_mu(-beta |g - xi_mu|^2 / 2) (g - xi_mu)``, written out."""
    distances = (g[..., None, :] - memory.xi).square().sum(dim=-1)
    weights = torch.softmax(-0.5 * memory.beta * distances, dim=-1)
    return g - weights @ memory.xi


def central_difference(function, x: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    """The gradient of the scalar ``function`` at ``x`` by central differences, entry by entry."""
    x = x.detach()
    gradient = torch.zeros_like(x)
    flat = gradient.view(-1)
    with torch.no_grad():
        for i in range(x.numel()):
            step = torch.zeros_like(x).view(-1)
            step[i] = h
            step = step.view_as(x)
            flat[i] = (function(x + step) - function(x - step)) / (2 * h)
    return gradient


def test_an_interaction_without_a_closed_form_gets_dE_dg_and_its_hessian_from_autograd():
    model, x0 = docs_model()
    memory = model.memory
    g = x0.clone()
    torch.testing.assert_close(memory.dE_dg(g), closed_form_dE_dg(memory, g), rtol=1e-12, atol=1e-12)
    numeric = central_difference(lambda point: float(memory.energy(point).sum()), g)
    torch.testing.assert_close(memory.dE_dg(g), numeric, rtol=1e-7, atol=1e-8)
    # the Hessian-vector products through it (what certificates use) against the dense Hessian
    point = g[0].clone().requires_grad_(True)
    v = torch.randn_like(point)
    (hv,) = torch.autograd.grad(memory.dE_dg(point[None])[0], point, v)
    dense = torch.autograd.functional.hessian(lambda y: memory.energy(y[None]).sum(), g[0]).reshape(8, 8)
    torch.testing.assert_close(hv.reshape(-1), dense @ v.reshape(-1), rtol=1e-10, atol=1e-12)
    # and the parameter gradient of dE/dg, which the implicit gradients read
    (by_autograd,) = torch.autograd.grad((memory.dE_dg(g) * v.expand_as(g)).sum(), memory.xi)
    (by_hand,) = torch.autograd.grad((closed_form_dE_dg(memory, g) * v.expand_as(g)).sum(), memory.xi)
    torch.testing.assert_close(by_autograd, by_hand, rtol=1e-10, atol=1e-12)


def test_a_neuron_from_its_lagrangian_alone_has_its_activation_and_metric():
    neuron = SigmoidNeuron(5).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    v = torch.randn_like(x)
    g = torch.sigmoid(x)
    torch.testing.assert_close(neuron(x), g, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(neuron.hessian_vector(x, v), g * (1 - g) * v, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(neuron.metric(x), torch.diag_embed(g * (1 - g)), rtol=1e-13, atol=1e-15)
    spread = (g * (1 - g)).amax(dim=(-1, -2)) / (g * (1 - g)).amin(dim=(-1, -2))
    torch.testing.assert_close(neuron.conditioning(x), spread, rtol=1e-12, atol=0)
    assert neuron.geometry == "euclidean" and neuron.free_dimension() == 5
    torch.testing.assert_close(neuron.project(v), v)


def test_the_identity_neuron_and_the_layer_norm_neuron_keep_their_contracts():
    identity = et_ode.IdentityNeuron(3)
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    v = torch.randn_like(x)
    assert identity(x) is not x and torch.equal(identity(x), x) and torch.equal(identity.hessian_vector(x, v), v)
    torch.testing.assert_close(identity.lagrangian(x), 0.5 * x.square().sum(dim=-1))
    assert torch.equal(identity.conditioning(x), torch.ones(2, dtype=torch.float64))
    layer_norm = et_ode.LayerNormNeuron(3).double()
    assert layer_norm.geometry == "spheres" and layer_norm.free_dimension() == 2
    # the base class's torch.func derivatives agree with the closed forms
    torch.testing.assert_close(et_ode.Neuron.forward(layer_norm, x), layer_norm(x), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        et_ode.Neuron.hessian_vector(layer_norm, x, v), layer_norm.hessian_vector(x, v), rtol=1e-10, atol=1e-12
    )
    assert sphere_neuron(layer_norm, "a tool") is layer_norm
    with pytest.raises(ValueError, match="a tool needs the LayerNorm neuron's sphere geometry.*IdentityNeuron"):
        sphere_neuron(identity, "a tool")
    assert GEOMETRIES == ("euclidean", "spheres")


def test_the_field_of_a_user_energy_is_its_gradient_flow_with_the_exact_energy_rate():
    model, x0 = docs_model()
    field = et_ode.ETField(model, tau=2.0)
    assert field.fused is None  # the fused path is the EnergyTransformer's
    torch.testing.assert_close(field(None, x0), -closed_form_dE_dg(model.memory, x0) / 2.0, rtol=1e-12, atol=1e-12)
    autograd = et_ode.ETField(model, tau=2.0, derivative="autograd")
    torch.testing.assert_close(autograd.velocity(x0), field.velocity(x0), rtol=1e-12, atol=1e-12)
    grad = closed_form_dE_dg(model.memory, x0)
    torch.testing.assert_close(field.dE_dt(x0), -grad.square().sum(dim=(-1, -2)) / 2.0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(field.tangent_gradient(x0), grad, rtol=1e-12, atol=1e-12)
    # the measured energy change over a short accurate solve is the integral of dE/dt
    solution = et_ode.solve(field, x0, (0.0, 1e-3), solver=et_ode.Adaptive(rtol=1e-12, atol=1e-14))
    change = model.energy(solution.x.detach()) - model.energy(x0)
    torch.testing.assert_close(change, 1e-3 * field.dE_dt(x0), rtol=1e-2, atol=1e-14)


@pytest.mark.parametrize("gradient", ["direct", "adjoint"])
def test_solve_gradients_of_a_user_energy_match_finite_differences(gradient):
    model, x0 = docs_model()
    field = et_ode.ETField(model)
    solver = et_ode.Adaptive(rtol=1e-11, atol=1e-13)
    mode = et_ode.Direct() if gradient == "direct" else et_ode.Adjoint(rtol=1e-11, atol=1e-13)
    weights = torch.randn(3, 4, 2, dtype=torch.float64)

    def loss(patterns: torch.Tensor, mode: object = None) -> torch.Tensor:
        with torch.no_grad() if mode is None else torch.enable_grad():
            if mode is None:
                model.memory.xi.copy_(patterns)
            solution = et_ode.solve(field, x0, (0.0, 2.0), solver=solver, gradient=mode or "direct", save="final")
            return (solution.g * weights).sum()

    original = model.memory.xi.detach().clone()
    (by_solve,) = torch.autograd.grad(loss(original, mode), model.memory.xi)
    numeric = central_difference(lambda p: float(loss(p)), original, h=1e-5)
    with torch.no_grad():
        model.memory.xi.copy_(original)
    torch.testing.assert_close(by_solve, numeric, rtol=1e-6, atol=1e-7)


def test_the_implicit_gradient_of_solve_on_a_user_energy_matches_finite_differences_of_the_attractor():
    model, x0 = docs_model()
    field = et_ode.ETField(model)
    weights = torch.randn(3, 4, 2, dtype=torch.float64)
    solution = et_ode.solve(field, x0, (0.0, 50.0), gradient=et_ode.Implicit(), stop=et_ode.SteadyState(1e-4), save="final")
    (implicit,) = torch.autograd.grad((solution.g * weights).sum(), model.memory.xi)
    start = solution.x.detach()
    original = model.memory.xi.detach().clone()

    def attractor_loss(patterns: torch.Tensor) -> float:
        with torch.no_grad():
            model.memory.xi.copy_(patterns)
            found = et_ode.find_attractor(field, start, flow=False, tol=1e-13)
        return float((found.x * weights).sum())

    numeric = central_difference(attractor_loss, original, h=1e-4)
    with torch.no_grad():
        model.memory.xi.copy_(original)
    assert float((implicit - numeric).abs().max()) <= 1e-6 * max(1.0, float(numeric.abs().max()))


def test_the_et_built_from_the_public_parts_is_the_energy_transformer():
    torch.manual_seed(0)
    parts = et_ode.EnergyModel(
        et_ode.LayerNormNeuron(8),
        {"attention": et_ode.EnergyAttention(8, 2, 4), "hopfield": et_ode.HopfieldMemory(8, 12, form="softmax")},
    ).double()
    torch.manual_seed(0)
    et = et_ode.EnergyTransformer(8, 2, 4, 12, hopfield="softmax").double()
    assert list(parts.state_dict()) == list(et.state_dict())  # checkpoints keep their keys
    for name, tensor in et.state_dict().items():
        assert torch.equal(parts.state_dict()[name], tensor), name
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(parts.energy(x), et.energy(x), rtol=0, atol=0)
    assert parts.energy_terms(x).keys() == {"attention", "hopfield"}
    fused, generic = et_ode.ETField(et), et_ode.ETField(parts)
    assert fused.fused is not None and generic.fused is None
    torch.testing.assert_close(fused.velocity(x), generic.velocity(x), rtol=1e-12, atol=1e-12)
    assert et.interactions == {"attention": et.attention, "hopfield": et.hopfield} and et.dim == 8


def test_a_sequence_of_interactions_is_named_by_position_and_summed():
    model, x0 = docs_model()
    twice = et_ode.EnergyModel(et_ode.IdentityNeuron(2), [model.memory, model.memory])
    assert twice.interaction_names == ("0", "1") and twice.reference_tensor is model.memory.xi
    torch.testing.assert_close(twice.energy(x0), 2 * model.energy(x0), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(twice.dE_dg(x0), 2 * model.dE_dg(x0), rtol=1e-14, atol=1e-14)
    assert twice.energy_terms(x0).keys() == {"0", "1"}


class Constant(et_ode.Interaction):
    def energy(self, g: torch.Tensor, mask=None) -> torch.Tensor:
        return g.sum(dim=(-1, -2)) * 0.0


class Upside(et_ode.Neuron):
    geometry = "spheres"

    def lagrangian(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().sum(dim=-1)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: et_ode.EnergyModel("neuron", [Constant()]), TypeError, "neuron must be an et_ode.Neuron, got str"),
        (lambda: et_ode.EnergyModel(et_ode.IdentityNeuron(2), []), ValueError, "interactions must hold at least one"),
        (
            lambda: et_ode.EnergyModel(et_ode.IdentityNeuron(2), [torch.nn.Linear(2, 2)]),
            TypeError,
            "interaction '0' must be an et_ode.Interaction, got Linear",
        ),
        (
            lambda: et_ode.EnergyModel(et_ode.IdentityNeuron(2), {"a b": Constant()}),
            ValueError,
            "interaction names must be identifiers other than 'neuron', got 'a b'",
        ),
        (
            lambda: et_ode.EnergyModel(et_ode.IdentityNeuron(2), {"neuron": Constant()}),
            ValueError,
            "interaction names must be identifiers",
        ),
        (lambda: et_ode.EnergyModel(Upside(2), [Constant()]), ValueError, "neuron Upside declares geometry 'spheres'"),
        (lambda: et_ode.IdentityNeuron(0), ValueError, "dim must be a positive integer, got 0"),
        (lambda: et_ode.IdentityNeuron(True), ValueError, "dim must be a positive integer, got True"),
        (
            lambda: et_ode.ETField(docs_model()[0], backend="fused"),
            ValueError,
            "backend='fused' is the EnergyTransformer's fast path, got a EnergyModel",
        ),
    ],
)
def test_bad_parts_are_refused_naming_the_argument(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_an_incomplete_interface_says_what_to_write():
    with pytest.raises(NotImplementedError, match="Interaction must define energy"):
        et_ode.Interaction().energy(torch.zeros(1, 2))
    with pytest.raises(NotImplementedError, match="Neuron must define lagrangian"):
        et_ode.Neuron(2)(torch.zeros(1, 2))


def test_states_are_validated_against_the_model():
    model, x0 = docs_model()
    with pytest.raises(TypeError, match="x has dtype torch.float32 but the model's parameters are torch.float64"):
        model.energy(x0.float())
    with pytest.raises(ValueError, match=r"x must have shape \(..., N, D\) with D=2"):
        model.energy(torch.zeros(3, 4, 5, dtype=torch.float64))
    free = et_ode.EnergyModel(et_ode.IdentityNeuron(2), [Constant()])  # no parameters: any floating dtype
    assert free.reference_tensor is None and float(free.energy(torch.ones(1, 2))) == 0.0
    assert math.isfinite(float(random_model().energy(torch.randn(4, 8, dtype=torch.float64))))
