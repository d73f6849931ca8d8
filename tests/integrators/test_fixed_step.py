"""The lean fixed-step loop (et_ode.integrators.fixed_step) against torchdiffeq's fixed-grid solvers, bit for bit.

Every comparison runs the same public ``solve`` call twice: once as shipped (the lean loop) and once with the lean
loop switched off, so that torchdiffeq's own loop integrates; states, gradients, statistics and failures must be
identical (``torch.equal``, not close).
"""

import importlib
import math
import warnings

import pytest
import torch
from torchdiffeq import odeint

from et_ode import ETField, EulerET, Fixed, SolveError, Status, solve
from et_ode.energy.checks import value_range
from et_ode.integrators.fixed_step import step_grid
from tests.conftest import random_model

integrate_module = importlib.import_module("et_ode.integrators.loop")  # where the loop is chosen

# (method, solve arguments): the paper's scheme on its own grid, fixed methods on the output grid and with a step
# that does not divide the output times (outputs interpolated inside a step)
CASES = [
    ("et", dict(solver=EulerET(0.1, 12))),
    ("euler", dict(t=torch.linspace(0.0, 1.0, 6, dtype=torch.float64), solver="euler")),
    ("euler", dict(t=torch.linspace(0.0, 1.0, 5, dtype=torch.float64), solver=Fixed("euler", step_size=0.07))),
    ("midpoint", dict(t=torch.linspace(0.0, 1.2, 4, dtype=torch.float64), solver=Fixed("midpoint", step_size=0.09))),
    ("rk4", dict(t=(0.5, 1.5), solver=Fixed("rk4", step_size=0.15))),
    ("rk4", dict(t=torch.linspace(0.0, 0.9, 4, dtype=torch.float64), solver=Fixed("rk4"))),
]


def setup(dtype: torch.dtype, seed: int = 0):
    model = random_model(hopfield="softmax", dtype=dtype, seed=seed, beta=0.7)
    mask = torch.rand(4, 4, generator=torch.Generator().manual_seed(seed)) < 0.7
    x0 = torch.randn(2, 4, 8, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    return model, ETField(model, tau=1.3, mask=mask), x0


def torchdiffeq_loop(monkeypatch, *args, **kwargs):
    """``solve`` with the lean loop switched off."""
    with monkeypatch.context() as patch:
        patch.setattr(integrate_module, "lean_loop_applies", lambda method, options: False)
        return solve(*args, **kwargs)


def same_stats(a, b):
    assert a.stats.nfe_forward == b.stats.nfe_forward and a.stats.accepted_steps == b.stats.accepted_steps
    assert a.stats.rejected_steps == b.stats.rejected_steps == 0
    assert a.stats.sample_evaluations == b.stats.sample_evaluations and a.stats.t_final == b.stats.t_final
    assert a.status is b.status is Status.REACHED_END
    assert torch.equal(a.ts, b.ts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method, kwargs", CASES)
@pytest.mark.parametrize("save", ["all", "final", "steps"])
def test_states_and_statistics_equal_torchdiffeq_bit_for_bit(monkeypatch, dtype, method, kwargs, save):
    _, field, x0 = setup(dtype)
    x0_copy = x0.clone()
    for grad_enabled in (False, True):
        with torch.set_grad_enabled(grad_enabled):
            lean = solve(field, x0, save=save, **kwargs)
            reference = torchdiffeq_loop(monkeypatch, field, x0, save=save, **kwargs)
        assert torch.equal(lean.x, reference.x) and torch.equal(lean.g, reference.g)
        assert (lean.xs is None) == (reference.xs is None) == (save == "final")
        if save != "final":
            assert torch.equal(lean.xs, reference.xs)
        same_stats(lean, reference)
    assert torch.equal(x0, x0_copy)  # the in-place updates never touch the caller's state


@pytest.mark.parametrize("method, kwargs", CASES[:1] + CASES[2:5])
def test_gradients_equal_torchdiffeq_bit_for_bit(monkeypatch, method, kwargs):
    model, field, x0 = setup(torch.float64, seed=1)
    x0 = x0.requires_grad_(True)
    weights = torch.randn(x0.shape, dtype=x0.dtype, generator=torch.Generator().manual_seed(5))
    inputs = (x0, *model.parameters())
    grads = []
    for run in (solve, lambda *a, **k: torchdiffeq_loop(monkeypatch, *a, **k)):
        solution = run(field, x0, **kwargs)
        loss = (solution.xs[1:].sum(dim=0) * weights).sum() + solution.g.square().sum()
        grads.append(torch.autograd.grad(loss, inputs, allow_unused=True))
    for lean, reference in zip(*grads, strict=True):
        assert (lean is None) == (reference is None)
        if lean is not None:
            assert torch.equal(lean, reference)
    assert grads[0][0].abs().sum() > 0 and grads[0][1].abs().sum() > 0  # gradients reach x0 and the weights


def test_paper_scheme_equals_odeint_on_its_grid_in_bfloat16():
    model, _, x0 = setup(torch.float64)
    model = model.to(torch.bfloat16)
    field, x0 = ETField(model), x0.to(torch.bfloat16)
    solution = solve(field, x0, solver=EulerET(0.1, 5))
    with torch.no_grad():
        reference = odeint(field, x0, solution.ts, method="euler")
    assert torch.equal(solution.xs, reference)


@pytest.mark.parametrize(
    "t, fail_time, steps",
    [
        ([0.0, 1e308, 1.5e308], 1e308, 2),  # the first step overflows: found at the start of the second
        ([0.0, 1.0, 1e308], 1e308, 2),  # the last step overflows: found at the end, the partial state is the last finite
    ],
)
def test_non_finite_state_fails_as_torchdiffeq_does(monkeypatch, t, fail_time, steps):
    _, field, x0 = setup(torch.float64)
    grid = torch.tensor(t, dtype=torch.float64)
    errors = []
    for run in (solve, lambda *a, **k: torchdiffeq_loop(monkeypatch, *a, **k)):
        field.reset_nfe()
        with pytest.raises(SolveError, match="non-finite") as info:
            run(field, x0, grid, solver="euler", save="final")
        errors.append((info.value, field.nfe))
    (lean, lean_nfe), (reference, reference_nfe) = errors
    assert str(lean) == str(reference) and lean.time == reference.time == fail_time
    assert lean_nfe == reference_nfe  # the replay that located the failure left the counter as torchdiffeq did
    a, b = lean.solution, reference.solution
    assert a.status is b.status is Status.FAILED
    assert torch.equal(a.ts, b.ts) and torch.equal(a.x.isfinite(), b.x.isfinite())
    assert torch.equal(a.x.nan_to_num(), b.x.nan_to_num())
    assert a.stats.accepted_steps == b.stats.accepted_steps == steps
    assert a.stats.nfe_forward == b.stats.nfe_forward and a.stats.sample_evaluations == b.stats.sample_evaluations


def test_fixed_steps_beyond_max_steps_are_refused_before_solving():
    _, field, x0 = setup(torch.float64)
    with pytest.raises(SolveError, match="max_steps=10"):
        solve(field, x0, solver=EulerET(0.1, 11), max_steps=10)
    assert field.nfe == 0
    assert solve(field, x0, solver=EulerET(0.1, 10), max_steps=10).stats.accepted_steps == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_value_range_finds_every_nan_and_infinity(dtype):
    """The solver's finiteness check of every step is ``value_range``'s two ends being finite."""

    def all_finite(t: torch.Tensor) -> bool:
        low, high = value_range(t)
        return math.isfinite(low) and math.isfinite(high)

    x = torch.randn(3, 37, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(x) and all_finite(x[:, ::2].transpose(0, 2))
    for value in (float("nan"), float("inf"), -float("inf")):
        for index in range(x.numel()):  # every position of the vectorized reduction's lanes and tail
            bad = x.clone()
            bad.view(-1)[index] = value
            assert not all_finite(bad), (value, index)
        assert not all_finite(bad.transpose(0, 2))


def test_growth_warning_as_torchdiffeq_path(monkeypatch):
    _, field, x0 = setup(torch.float64)
    x0 = x0 * 1e-4  # a step of 5 from here grows max |x| about 10^4-fold
    solutions = []
    for run in (solve, lambda *a, **k: torchdiffeq_loop(monkeypatch, *a, **k)):
        with pytest.warns(RuntimeWarning, match="grew the state"), torch.no_grad():
            solutions.append(run(field, x0, solver=EulerET(5.0, 3), save="final"))
    assert torch.equal(solutions[0].x, solutions[1].x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # small steps: no warning on either path
        solve(field, x0, solver=EulerET(0.1, 3))


def test_the_euler_increment_never_scales_a_subclass_output_in_place():
    """The lean loop scales an ETField's fresh output in place; a subclass may return a tensor it keeps (here one
    constant velocity), which must come out of the solve untouched, with the states ``x0 + k dt v``."""

    class ConstantVelocity(ETField):
        def __init__(self, model, velocity):
            super().__init__(model)
            self.constant = velocity

        def forward(self, t, x):
            self.count_evaluations()
            return self.constant

    model = random_model(dtype=torch.float64)
    x0 = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    velocity = torch.randn_like(x0)
    kept = velocity.clone()
    with torch.no_grad():
        solution = solve(ConstantVelocity(model, velocity), x0, solver=EulerET(0.1, 5), save="final")
    assert torch.equal(velocity, kept)
    times = step_grid(torch.tensor([0.0, 0.5], dtype=torch.float64), 0.1)  # the loop's float64 step times
    expected = x0
    for dt in times.diff():
        expected = expected + dt * kept
    assert torch.equal(solution.x, expected)


@pytest.mark.parametrize("method, kwargs", [case for case in CASES if case[0] in ("midpoint", "rk4")])
def test_a_time_dependent_subclass_gets_torchdiffeqs_stage_times(monkeypatch, method, kwargs):
    """The lean loop hands no times to an ETField, which never reads them, but a subclass may: a field ``(1 + t^2) f``
    integrated by every multi-stage method gets the stage times torchdiffeq's loop computes, bit for bit (and its
    states differ from the autonomous field's, so the times matter)."""

    class TimeScaled(ETField):
        def forward(self, t, x):
            return super().forward(t, x) * (1 + t * t)

    model, _, x0 = setup(torch.float64)
    field = TimeScaled(model, tau=1.3)
    lean = solve(field, x0, save="final", **kwargs)
    reference = torchdiffeq_loop(monkeypatch, field, x0, save="final", **kwargs)
    assert torch.equal(lean.x, reference.x)
    autonomous = solve(ETField(model, tau=1.3), x0, save="final", **kwargs)
    assert not torch.allclose(lean.x, autonomous.x, rtol=1e-6, atol=0)
