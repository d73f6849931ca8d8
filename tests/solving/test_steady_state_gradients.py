"""Gradients through a steady-state stop: the stop test depends on the parameters directly, not only through the
state, and that term must reach them (torchdiffeq's odeint_event carries the stop time through the state only)."""

import copy

import pytest
import torch

from et_ode import Adaptive, Adjoint, ETField, SolveError, SteadyState, solve
from tests.conftest import random_model


def stopped_loss(model, x0, weights, gradient="direct", **kwargs):
    gradient = Adjoint(rtol=1e-13, atol=1e-15) if gradient == "adjoint" else gradient
    out = solve(
        ETField(model, tau=1.5),
        x0,
        (0.0, 1e4),
        solver=Adaptive(rtol=1e-11, atol=1e-13),
        gradient=gradient,
        save="final",
        **kwargs,
    )
    assert out.status.value == "steady_state" and 0 < out.stats.t_final < 1e4
    return (weights * out.g).sum(), out


slow = pytest.mark.slow


@pytest.mark.parametrize(
    "hopfield, grad, measure, tol, bound",
    [
        ("softmax", "direct", "dg_dt", 1e-3, 1e-6),
        ("softmax", "direct", "tangent_gradient", 0.05, 1e-6),
        pytest.param("softmax", "adjoint", "dg_dt", 1e-3, 1e-6, marks=slow),
        pytest.param("softmax", "adjoint", "tangent_gradient", 0.05, 1e-6, marks=slow),
        # ReLU kinks: adaptive steps make the solve only piecewise smooth in the parameters (README): ~2e-4 here,
        # against 28% without the stop test's parameter term
        pytest.param("relu", "direct", "tangent_gradient", 0.2, 1e-3, marks=slow),
        pytest.param("relu", "direct", "dg_dt", 1e-3, 1e-3, marks=slow),
        pytest.param("relu", "adjoint", "dg_dt", 1e-3, 1e-3, marks=slow),
    ],
)
def test_gradient_through_the_stop_equals_finite_differences(hopfield, grad, measure, tol, bound):
    model = random_model(hopfield=hopfield, seed=1, beta=0.6, eps=1e-3)
    x0 = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    weights = torch.randn_like(x0)
    options = dict(stop=SteadyState(tol, measure=measure))
    model.zero_grad()
    loss, out = stopped_loss(model, x0, weights, gradient=grad, **options)
    assert out.stats.steady_state_measure == measure
    loss.backward()
    generator = torch.Generator().manual_seed(2)
    direction = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in model.parameters()]
    analytic = sum(float((p.grad * d).sum()) for p, d in zip(model.parameters(), direction))

    def shifted(h):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p, d in zip(m.parameters(), direction):
                p.add_(h * d)
            return float(stopped_loss(m, x0, weights, **options)[0])

    h = 1e-5  # the stop time is strongly curved in theta: Richardson-extrapolated central differences, O(h^4)
    fd = (8 * (shifted(h) - shifted(-h)) - (shifted(2 * h) - shifted(-2 * h))) / (12 * h)
    assert abs(analytic - fd) <= bound * abs(fd), (analytic, fd)


def test_error_messages_name_the_measure():
    model = random_model(hopfield="softmax")
    x0 = torch.randn(1, 3, 8, dtype=torch.float64)
    with pytest.raises(SolveError, match=r"RMS \|T dE/dg\|"):
        solve(ETField(model), x0, (0.0, 0.1), gradient="implicit", stop=SteadyState(1e-12, measure="tangent_gradient"))
    with pytest.raises(SolveError, match=r"RMS \|dg/dt\|"):
        solve(ETField(model), x0, (0.0, 0.1), gradient="implicit", stop=SteadyState(1e-12))
