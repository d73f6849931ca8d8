"""Values the library must return exactly, at non-default settings: constructor arguments that become numbers.

These pin down what a changed constant or a swapped branch in a constructor would alter (found by mutation
testing, ``make mutate``): each asserts a value against its definition, not against another of our code paths.
"""

import math

import pytest
import torch

from et_ode import EnergyTransformer, LayerNormNeuron
from et_ode.neurons import inverse_softplus


@pytest.mark.parametrize("y", [1e-3, 0.5, 1.7, 30.0])
def test_inverse_softplus_inverts_softplus(y):
    assert math.log1p(math.exp(inverse_softplus(y))) == pytest.approx(y, rel=1e-12)


def test_neuron_stores_the_gamma_and_eps_it_is_given():
    neuron = LayerNormNeuron(5, gamma=1.7, eps=3e-3).double()
    assert float(neuron.gamma) == pytest.approx(1.7, rel=1e-6)  # gamma_raw is created in the default dtype
    assert neuron.eps == 3e-3 and neuron.dim == 5
    assert torch.equal(neuron.delta, torch.zeros(5, dtype=torch.float64))
    free = LayerNormNeuron(5, gamma=-0.4, positive_gamma=False)
    assert float(free.gamma) == pytest.approx(-0.4, rel=1e-6)
    assert LayerNormNeuron(2).dim == 2  # the smallest token size


def test_model_passes_its_settings_to_the_parts():
    model = EnergyTransformer(6, 2, 3, 5, hopfield="softmax", beta=[0.7, 1.9], beta_hn=3.0, eps=1e-2,
                              self_attention=True)
    assert model.neuron.eps == 1e-2 and model.hopfield.beta == 3.0 and model.attention.self_attention
    assert model.attention.beta.tolist() == pytest.approx([0.7, 1.9])
    assert EnergyTransformer(6, 2, 4, 5).attention.beta.tolist() == pytest.approx([0.5, 0.5])  # 1/sqrt(Y)
    assert EnergyTransformer(6, 2, 3, 5, hopfield="softplus").hopfield.beta == 4.0
