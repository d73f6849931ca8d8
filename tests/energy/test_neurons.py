"""The LayerNorm Lagrangian: its gradient and Hessian against autograd."""

import pytest
import torch
from torch.autograd.functional import jvp

from et_ode import LayerNormNeuron


def make_neuron(dim: int = 7, gamma: float = 1.7, eps: float = 1e-3) -> LayerNormNeuron:
    torch.manual_seed(0)
    neuron = LayerNormNeuron(dim, gamma=gamma, eps=eps).double()
    with torch.no_grad():
        neuron.delta.normal_()
    return neuron


def test_activation_is_gradient_of_lagrangian():
    neuron = make_neuron()
    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(neuron.lagrangian(x).sum(), x)
    torch.testing.assert_close(neuron(x), grad, rtol=1e-10, atol=1e-12)


def test_activation_matches_layer_norm_definition():
    neuron = make_neuron()
    x = torch.randn(4, 7, dtype=torch.float64)
    reference = torch.nn.functional.layer_norm(x, (7,), eps=neuron.eps) * neuron.gamma + neuron.delta
    torch.testing.assert_close(neuron(x), reference, rtol=1e-10, atol=1e-12)


def test_hessian_vector_matches_autograd_jvp():
    neuron = make_neuron()
    x = torch.randn(2, 5, 7, dtype=torch.float64)
    v = torch.randn_like(x)
    _, reference = jvp(neuron, x, v)
    torch.testing.assert_close(neuron.hessian_vector(x, v), reference, rtol=1e-10, atol=1e-12)


def test_hessian_is_positive_semidefinite_with_known_spectrum():
    neuron = make_neuron(dim=6, gamma=0.8, eps=1e-2)
    x = torch.randn(6, dtype=torch.float64)
    hessian = torch.stack([neuron.hessian_vector(x[None], e[None])[0] for e in torch.eye(6, dtype=torch.float64)])
    torch.testing.assert_close(hessian, hessian.T, rtol=0, atol=1e-12)
    xt = x - x.mean()
    sigma = torch.sqrt(xt.square().mean() + neuron.eps)
    gamma = neuron.gamma.detach()
    expected = sorted([0.0, float(gamma * neuron.eps / sigma**3)] + [float(gamma / sigma)] * 4)
    torch.testing.assert_close(
        torch.linalg.eigvalsh(hessian), torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=1e-12
    )


def test_gamma_stays_positive_for_any_raw_value():
    neuron = make_neuron()
    with torch.no_grad():
        neuron.gamma_raw.fill_(-50.0)
    assert float(neuron.gamma.detach()) > 0


@pytest.mark.parametrize(
    "kwargs, word", [({"gamma": 0.0}, "gamma"), ({"gamma": -1.0}, "gamma"), ({"eps": 0.0}, "eps"), ({"eps": -1e-5}, "eps")]
)
def test_non_positive_gamma_or_eps_rejected(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LayerNormNeuron(8, **kwargs)


def test_unconstrained_gamma_may_be_negative():
    neuron = LayerNormNeuron(8, gamma=-0.5, positive_gamma=False)
    assert float(neuron.gamma.detach()) == -0.5
