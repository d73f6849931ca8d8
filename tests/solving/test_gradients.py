"""Gradients through solves: direct vs adjoint vs implicit, and gradcheck."""

import copy
import warnings

import pytest
import torch
from torch.func import functional_call

from et_ode import Adaptive, Adjoint, ETField, Fixed, Implicit, SolveError, SteadyState, find_attractor, solve
from tests.conftest import random_model


def parameter_gradients(model, x0, target, **kwargs):
    model.zero_grad()
    x0 = x0.clone().requires_grad_(True)
    solution = solve(ETField(model), x0, save="final", **kwargs)
    ((solution.g - target) ** 2).sum().backward()
    x0_grad = torch.zeros_like(x0) if x0.grad is None else x0.grad
    return torch.cat([p.grad.flatten() for p in model.parameters()] + [x0_grad.flatten()]), solution


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "hopfield, rtol, bound",
    [
        ("softmax", 1e-11, 1e-10),
        ("softplus", 1e-11, 1e-10),
        ("relu", 1e-7, 3e-3),
        pytest.param("relu", 1e-9, 5e-4, marks=pytest.mark.slow),
        pytest.param("relu", 1e-11, 1e-4, marks=pytest.mark.slow),
    ],
)
def test_adjoint_equals_direct(hopfield, rtol, bound):
    """The README's figures (dopri5; measured on this model): smooth energies 5e-12 (softmax) and 5e-11 (softplus)
    at rtol 1e-11. ReLU memories make the field only once differentiable where an overlap crosses zero: adaptive
    step-size control then differs between the forward and the adjoint solve: 1.3e-3 at rtol 1e-7, 2.0e-4 at
    rtol 1e-9, 2.2e-5 at rtol 1e-11."""
    model = random_model(hopfield=hopfield, seed=1)
    torch.manual_seed(0)
    x0 = torch.randn(2, 4, 8, dtype=torch.float64)
    target = torch.randn_like(x0)
    options = dict(t=(0.0, 3.0), solver=Adaptive(rtol=rtol, atol=rtol / 100))
    direct, _ = parameter_gradients(model, x0, target, **options)
    adjoint, solution = parameter_gradients(model, x0, target, gradient="adjoint", **options)
    assert relative(adjoint, direct) < bound
    assert solution.stats.nfe_backward > 0


def test_adjoint_with_seminorm_and_fixed_steps():
    model = random_model(hopfield="relu", seed=2)
    x0 = torch.randn(1, 3, 8, dtype=torch.float64)
    target = torch.randn_like(x0)
    rk4 = Fixed("rk4", step_size=0.01)
    direct, _ = parameter_gradients(model, x0, target, t=(0.0, 1.0), solver=rk4)
    adjoint, _ = parameter_gradients(model, x0, target, t=(0.0, 1.0), solver=rk4, gradient=Adjoint(method="rk4"))
    assert relative(adjoint, direct) < 1e-7  # the continuous adjoint vs the discrete one, O(step^4): 4e-8 measured
    semi, _ = parameter_gradients(
        model, x0, target, t=(0.0, 1.0), solver=Adaptive(rtol=1e-9, atol=1e-11), gradient=Adjoint(seminorm=True)
    )
    assert relative(semi, direct) < 1e-4


class Solved(torch.nn.Module):
    def __init__(self, gradient: str):
        super().__init__()
        self.model = random_model(4, 1, 2, 3, hopfield="softmax", seed=5)
        self.gradient = gradient

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return solve(
            ETField(self.model), x0, (0.0, 0.5), solver=Fixed("rk4", step_size=0.05), gradient=self.gradient, save="final"
        ).g


@pytest.mark.parametrize("grad", ["direct", "adjoint"])
def test_gradcheck_through_the_solve(grad):
    solved = Solved(grad)
    x0 = torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(solved, (x0,), atol=1e-6, rtol=1e-5)
    if grad == "direct":  # parameters too, through functional_call
        wk = solved.model.attention.WK.detach().clone().requires_grad_(True)
        xi = solved.model.hopfield.xi.detach().clone().requires_grad_(True)

        def of_weights(wk, xi):
            return functional_call(solved, {"model.attention.WK": wk, "model.hopfield.xi": xi}, (x0.detach(),))

        assert torch.autograd.gradcheck(of_weights, (wk, xi), atol=1e-6, rtol=1e-5)


def converging_model():
    """One token with self-attention and sharp softmax memories: converges about like 1/t (see et_ode.dynamics.manifold)."""
    model = random_model(8, 2, 4, 6, hopfield="softmax", beta_hn=10.0, self_attention=True, seed=0)
    with torch.no_grad():
        model.attention.WK.mul_(0.05)
        model.hopfield.xi.mul_(3.0)
    return model


def test_implicit_equals_direct_through_a_long_converged_solve():
    model = converging_model()
    x0 = torch.randn(2, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    target = torch.randn_like(x0)
    tight = Adaptive(rtol=1e-10, atol=1e-12)
    adjoint, long_solve = parameter_gradients(
        model, x0, target, t=(0.0, 1e7), solver=tight, gradient="adjoint"
    )  # equals direct backpropagation to 1e-10
    implicit, fixed = parameter_gradients(
        model, x0, target, t=(0.0, 1e9), solver=tight, gradient=Implicit(tol=1e-12), stop=SteadyState(1e-12)
    )
    n_params = sum(p.numel() for p in model.parameters())
    assert fixed.status.value == "steady_state"
    assert relative(implicit[:n_params], adjoint[:n_params]) < 1e-5  # the README's figure; 5.6e-6 measured
    assert float(implicit[n_params:].abs().max()) == 0.0  # the fixed point does not depend on x0 locally
    assert 0 < fixed.stats.nfe_backward < 100  # conjugate-gradient Hessian-vector products, not a backward solve


def test_implicit_needs_a_converged_solve():
    model = converging_model()
    x0 = torch.randn(1, 1, 8, dtype=torch.float64)
    with pytest.raises(SolveError, match="converged fixed point"):
        solve(ETField(model), x0, (0.0, 1.0), gradient="implicit", stop=SteadyState(1e-12))


def _implicit_parameter_gradient(model, x0, target, path, tol):
    """Parameter gradients of ``|g* - target|^2`` at a fixed point, by ``path``: ``solve(gradient=Implicit(tol))`` from
    ``x0``, or :func:`find_attractor` with ``flow=False`` at ``x0`` itself (``x0`` is then a converged state): the
    same certified attractor's rerouting, reached two ways."""
    model.zero_grad()
    field = ETField(model)
    if path == "solve":
        g = solve(
            field,
            x0,
            (0.0, 1e5),
            solver=Adaptive(rtol=1e-6, atol=1e-8),
            stop=SteadyState(1e-4),
            gradient=Implicit(tol=tol),
            save="final",
        ).g
    else:
        g = find_attractor(field, x0, flow=False, implicit=Implicit(tol=tol)).g
    (g - target).square().sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("path", ["solve", "fixed_point"])
def test_float32_implicit_gradients_agree_with_float64(path):
    """In float32 the Hessian-vector products' rounding stalls conjugate gradients near 1e-6 relative: the default
    tolerance (1e-3 there) is reached without a warning, and a float64 one (1e-8) runs every iteration and warns,
    yet its gradient must stay right. Along the directions the Riemannian Hessian annihilates (radial, mean) the
    residual sees nothing, and there float32 conjugate gradients drift (a step of huge alpha where p.Ap is rounding
    noise): without projecting the solution back onto the tangent spaces these gradients were off by 26% (solve)
    and 42% (fixed point). Measured relative to float64: 4.0e-5 and 2.9e-4 (default), 5.4e-6 and 2.9e-7 (1e-8)."""
    model64 = random_model(8, 2, 4, 12, seed=3)
    model32 = copy.deepcopy(model64).float()
    x0 = torch.randn(3, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(3, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    if path == "fixed_point":  # one converged state for both precisions
        x0 = solve(
            ETField(model64), x0, (0.0, 1e5), solver=Adaptive(rtol=1e-10, atol=1e-12), stop=SteadyState(1e-10), save="final"
        ).x.detach()
    want = _implicit_parameter_gradient(model64, x0, target, path, tol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default tolerance is reachable in float32
        default = _implicit_parameter_gradient(model32, x0.float(), target.float(), path, tol=None)
    with pytest.warns(RuntimeWarning, match="conjugate gradients stopped after 200 iterations"):
        tight = _implicit_parameter_gradient(model32, x0.float(), target.float(), path, tol=1e-8)
    assert relative(default.double(), want) < 1e-3
    assert relative(tight.double(), want) < 1e-4
