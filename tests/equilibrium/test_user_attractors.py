"""find_attractor on energies the library did not design: certificates against dense Hessians
(``torch.autograd.functional.hessian``) and implicit gradients against finite differences, in float64, for the
identity neuron, a user's neuron whose metric varies with the state, and the LayerNorm neuron with a user's
interaction (the spheres)."""

from __future__ import annotations

import pytest
import torch

import et_ode
from tests.energy.test_user_energies import SigmoidNeuron, docs_model


class Hopfield1984(et_ode.Interaction):
    """The docs' network (docs/guides/own-energy.md): the flow is ``tau dx/dt = -x + W g + b``."""

    def __init__(self, weights: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.W = torch.nn.Parameter((weights + weights.T) / 2)
        self.b = torch.nn.Parameter(bias)

    def energy(self, g: torch.Tensor, mask=None) -> torch.Tensor:
        entropy = (g * g.log() + (1 - g) * (1 - g).log()).sum(dim=(-1, -2))
        return entropy - 0.5 * ((g @ self.W) * g).sum(dim=(-1, -2)) - (g @ self.b).sum(dim=-1)


class SoftmaxMemory(et_ode.Interaction):
    """The ET's softmax Hopfield energy, written by a user without its closed-form gradient."""

    def __init__(self, xi: torch.Tensor, beta: float):
        super().__init__()
        self.xi = torch.nn.Parameter(xi)
        self.beta = beta

    def energy(self, g: torch.Tensor, mask=None) -> torch.Tensor:
        return -(torch.logsumexp(self.beta * g @ self.xi.T, dim=-1) / self.beta).sum(dim=-1)


def hopfield_network(seed: int = 1) -> et_ode.EnergyModel:
    torch.manual_seed(seed)
    return et_ode.EnergyModel(SigmoidNeuron(6), [Hopfield1984(2.0 * torch.randn(6, 6), torch.randn(6))]).double()


def implicit_against_finite_differences(
    model: et_ode.EnergyModel,
    x0: torch.Tensor,
    parameter: torch.nn.Parameter,
    *,
    h: float = 1e-4,
    tol: float = 1e-13,
    directions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, et_ode.Attractor]:
    """``d/dp sum(w * g*)`` along each entry of ``parameter`` (or along ``directions`` random unit directions), by the
    implicit gradient of find_attractor and by central differences of the attractor found by Newton from the
    unperturbed one (``flow=False``, to ``tol``): both ``(entries or directions,)``, and the attractor."""
    field = et_ode.ETField(model)
    found = et_ode.find_attractor(field, x0)
    assert all(status == "certified" for status in found.status), found.status
    generator = torch.Generator().manual_seed(5)
    weights = torch.randn(found.g.shape, dtype=torch.float64, generator=generator)
    (implicit,) = torch.autograd.grad((found.g * weights).sum(), parameter)
    start, original = found.x.detach(), parameter.detach().clone()
    size = original.numel()
    basis = torch.eye(size, dtype=torch.float64)
    if directions is not None:
        basis = torch.randn(directions, size, dtype=torch.float64, generator=generator)
        basis = basis / basis.norm(dim=1, keepdim=True)
    numeric = torch.zeros(len(basis), dtype=torch.float64)
    with torch.no_grad():
        for i, direction in enumerate(basis):
            values = []
            for sign in (1.0, -1.0):
                parameter.copy_(original + sign * h * direction.view_as(original))
                moved = et_ode.find_attractor(field, start, flow=False, tol=tol)
                values.append(float((moved.g * weights).sum()))
            numeric[i] = (values[0] - values[1]) / (2 * h)
        parameter.copy_(original)
    return basis @ implicit.flatten(), numeric, found


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def test_the_docs_energy_certified_with_the_dense_hessian_and_implicit_gradients():
    model, x0 = docs_model()
    implicit, numeric, found = implicit_against_finite_differences(model, x0, model.memory.xi)
    assert found.geometry == ("x", "x", "x") and bool(found.outward_force.isnan().all())
    assert relative_error(implicit, numeric) <= 1e-6
    for b in range(3):  # the certificate's eigenvalue is the dense Hessian's smallest (Lanczos on all N D = 8)
        dense = torch.autograd.functional.hessian(lambda g: model.energy_g(g), found.g[b].detach()).reshape(8, 8)
        assert float(found.smallest_eigenvalue[b]) == pytest.approx(float(torch.linalg.eigvalsh(dense)[0]), rel=1e-9)
        assert float(found.largest_eigenvalue[b]) == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-9)
    torch.testing.assert_close(found.g.detach(), found.x)  # g = x


def test_a_varying_metric_certified_by_the_hessian_of_e_of_g_of_x():
    model = hopfield_network()
    layer = model.get_submodule("0")
    x0 = torch.randn(4, 1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    implicit_w, numeric_w, found = implicit_against_finite_differences(model, x0, layer.W)
    assert relative_error(implicit_w, numeric_w) <= 1e-6
    implicit_b, numeric_b, _ = implicit_against_finite_differences(model, x0, layer.b)
    assert relative_error(implicit_b, numeric_b) <= 1e-6
    g = found.g.detach()
    torch.testing.assert_close(found.x, g @ layer.W.detach() + layer.b.detach(), rtol=0, atol=1e-11)  # x = W g + b
    for b in range(4):  # Hess of F(x) = E(sigmoid(x)), dense, third derivative of the Lagrangian included
        dense = torch.autograd.functional.hessian(lambda x: model.energy(x), found.x[b]).reshape(6, 6)
        assert float(found.smallest_eigenvalue[b]) == pytest.approx(float(torch.linalg.eigvalsh(dense)[0]), rel=1e-8)


def test_a_user_interaction_on_the_spheres_is_the_et_it_spells_out():
    torch.manual_seed(3)
    et = et_ode.EnergyTransformer(6, 2, 3, 10, hopfield="softmax", beta_hn=2.0).double()
    with torch.no_grad():
        et.neuron.delta.normal_(0.0, 0.3)
    spelled = et_ode.EnergyModel(
        et.neuron, {"attention": et.attention, "memory": SoftmaxMemory(et.hopfield.xi.detach().clone(), beta=2.0)}
    )
    x0 = torch.randn(2, 4, 6, dtype=torch.float64)
    with torch.no_grad():
        reference = et_ode.find_attractor(et_ode.ETField(et), x0)
    implicit, numeric, found = implicit_against_finite_differences(spelled, x0, spelled.memory.xi, tol=1e-12, directions=4)
    assert found.geometry == ("spheres", "spheres") and found.status == reference.status
    torch.testing.assert_close(found.g.detach(), reference.g, rtol=0, atol=1e-7)
    torch.testing.assert_close(found.smallest_eigenvalue, reference.smallest_eigenvalue, rtol=1e-6, atol=1e-10)
    assert relative_error(implicit, numeric) <= 1e-6


def test_a_non_convex_neuron_flows_uphill_and_the_lyapunov_check_says_so():
    from et_ode.analysis import check_lyapunov

    class Concave(et_ode.Neuron):
        def lagrangian(self, x: torch.Tensor) -> torch.Tensor:
            return -0.5 * x.square().sum(dim=-1)

    model, x0 = docs_model()
    concave = et_ode.EnergyModel(Concave(2), [model.memory])
    report = check_lyapunov(et_ode.solve(et_ode.ETField(concave), x0, torch.linspace(0.0, 0.5, 6, dtype=torch.float64)))
    assert not report.m_psd and report.m_min_eigenvalue == pytest.approx(-1.0)
    assert not any(report.descends) and report.gamma is None and report.neuron == "Concave"
    assert "M not PSD" in {v.kind for v in report.violations}


def test_the_euclidean_flow_is_not_rescaled_and_the_certificate_uses_every_direction():
    model, _ = docs_model()
    x0 = 10.0 * torch.randn(2, 1, 2, dtype=torch.float64)  # far out: the spheres' rescaling would move the state
    found = et_ode.find_attractor(et_ode.ETField(model), x0)
    assert found.status == ("certified", "certified")
    patterns = model.memory.xi.detach()
    nearest = (found.x[:, 0, None, :] - patterns).norm(dim=-1).amin(dim=-1)
    assert bool((nearest < 0.1).all())  # each ends next to a stored pattern, as the flow does
    flowed = et_ode.solve(et_ode.ETField(model), x0, (0.0, 60.0), solver=et_ode.Adaptive(rtol=1e-10, atol=1e-12)).x
    torch.testing.assert_close(found.x, flowed.detach(), rtol=0, atol=1e-7)
