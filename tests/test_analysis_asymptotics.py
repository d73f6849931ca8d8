"""The predicted power-law exponent p = lambda_min(K^(-1/2) Hess_R K^(-1/2)) against a generalized eigenproblem
on the torch.func Hessian, and against the exponent measured on long float64 solves."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from et_ode import ETField
from et_ode.analysis.asymptotics import measured_exponent, plot_asymptotics, predicted_exponent
from et_ode.analysis.stability import find_fixed_point, riemannian_hessian_matrix

from .conftest import random_model


def tiny(hopfield: str):
    return ETField(random_model(dim=5, heads=1, head_dim=3, memories=4, hopfield=hopfield, seed=1), tau=0.7)


def test_predicted_exponent_is_a_generalized_eigenvalue_of_the_hessian_and_the_outward_forces():
    field = tiny("softmax")
    x0 = torch.randn(1, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x_star = find_fixed_point(field, x0, tol=1e-11, max_iter=5000).x
    predicted = predicted_exponent(field, x_star[0])
    # independent: Hess_R c = p K c with the torch.func Hessian and rho_A = -s_A . dE/dg_A from autograd of E
    matrix, _ = riemannian_hessian_matrix(field, predicted.x[None])
    model = field.model
    g = model.neuron(predicted.x).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(model.energy_g(g), g)
    u = (g - model.neuron.delta).detach()
    u = u - u.mean(-1, keepdim=True)
    rho = -(grad * u / u.norm(dim=-1, keepdim=True)).sum(-1)
    kappa = rho / u.norm(dim=-1)
    values = scipy.linalg.eigh(matrix[0].numpy(), np.diag(kappa.repeat_interleave(3).numpy()), eigvals_only=True)
    assert predicted.rho.tolist() == pytest.approx(rho.tolist(), rel=1e-10)
    assert predicted.exponent == pytest.approx(values[0], rel=1e-9)
    assert predicted.eigenvalues.numpy() == pytest.approx(values, rel=1e-9)


@pytest.mark.parametrize(("hopfield", "rel"), [("softmax", 0.01), ("relu", 0.07)])
def test_measured_exponent_matches_the_prediction(hopfield: str, rel: float, tmp_path):
    """softmax: 0.613 measured to t = 1e4 against 0.609 predicted; ReLU: 0.585 against 0.550 (0.576 at t = 1e5:
    the kinks of the ReLU energy slow the approach to the asymptotic regime)."""
    field = tiny(hopfield)
    x0 = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    rate = measured_exponent(field, x0, t_end=1e4)
    assert rate.fit.rms_log_residual < 0.01  # a straight line in log-log, i.e. in intrinsic time
    assert rate.exponent == pytest.approx(rate.predicted.exponent, rel=rel)
    plot_asymptotics([rate], labels=[hopfield], path=tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 5000
