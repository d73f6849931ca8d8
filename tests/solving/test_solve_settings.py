"""The settings objects of solve (solvers, gradients, stop, Integration): validation, shorthands, the rules they own,
and the dispatcher's behaviour (bit for bit against hand loops, a float64 reference, one integration per solve)."""

import dataclasses
import inspect
import json
import math

import pytest
import torch

from et_ode import (
    METHODS,
    Adaptive,
    Adjoint,
    Direct,
    ETField,
    EulerET,
    Fixed,
    Implicit,
    Integration,
    SolveError,
    Status,
    SteadyState,
    solve,
)
from et_ode.integrators.solvers import as_solver
from et_ode.solving.gradients import as_gradient
from et_ode.solving.integration import settings_from_dict, settings_to_dict
from tests.conftest import hand_rk4, random_model


def setup(seed: int = 0, batch: int = 2, n: int = 4, dtype: torch.dtype = torch.float64):
    model = random_model(hopfield="softmax", seed=seed, beta=0.7, eps=1e-3, dtype=dtype)
    x0 = torch.randn(batch, n, 8, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    return model, ETField(model, tau=1.3), x0


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "make, error, name",
    [
        (lambda: Adaptive("rk4"), ValueError, "Adaptive.method"),
        (lambda: Adaptive(rtol=0.0), ValueError, "Adaptive.rtol"),
        (lambda: Adaptive(atol=math.nan), ValueError, "Adaptive.atol"),
        (lambda: Adaptive(rtol=True), ValueError, "Adaptive.rtol"),
        (lambda: Adaptive(options=[1]), TypeError, "Adaptive.options"),
        (lambda: Fixed("dopri5"), ValueError, "Fixed.method"),
        (lambda: Fixed("et"), ValueError, "EulerET"),
        (lambda: Fixed(step_size=-0.1), ValueError, "Fixed.step_size"),
        (lambda: Fixed(step_size=math.inf), ValueError, "Fixed.step_size"),
        (lambda: Fixed(options={"step_size": 0.1}), ValueError, "step_size"),
        (lambda: EulerET(alpha=0.0), ValueError, "EulerET.alpha"),
        (lambda: EulerET(steps=0), ValueError, "EulerET.steps"),
        (lambda: EulerET(steps=2.5), ValueError, "EulerET.steps"),
        (lambda: Adjoint(rtol=-1.0), ValueError, "Adjoint.rtol"),
        (lambda: Adjoint(atol=math.nan), ValueError, "Adjoint.atol"),
        (lambda: Adjoint(method="et"), ValueError, "Adjoint.method"),
        (lambda: Adjoint(seminorm=1), TypeError, "Adjoint.seminorm"),
        (lambda: Implicit(tol=0.0), ValueError, "Implicit.tol"),
        (lambda: Implicit(max_iter=0), ValueError, "Implicit.max_iter"),
        (lambda: SteadyState(0.0), ValueError, "SteadyState.tol"),
        (lambda: SteadyState(math.inf), ValueError, "SteadyState.tol"),
        (lambda: SteadyState(1e-3, measure="energy"), ValueError, "SteadyState.measure"),
        (lambda: SteadyState(1e-3, per_sample="yes"), TypeError, "SteadyState.per_sample"),
        (lambda: Integration(t1=0.0), ValueError, "Integration.t1"),
        (lambda: Integration(max_steps=0), ValueError, "Integration.max_steps"),
        (lambda: Integration(stop=1e-3), TypeError, "Integration.stop"),
        (lambda: Integration(solver="rk45"), ValueError, "solver"),
        (lambda: Integration(gradient="backprop"), ValueError, "gradient"),
    ],
)
def test_each_object_validates_itself_naming_the_argument(make, error, name):
    with pytest.raises(error, match=name):
        make()


def test_objects_are_frozen_and_compare_by_value():
    solver = Adaptive(rtol=1e-7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        solver.rtol = 1.0  # type: ignore[misc]
    assert solver == Adaptive("dopri5", 1e-7, 1e-6) and EulerET() == EulerET(0.1, 12)
    assert SteadyState(1e-3) != SteadyState(1e-3, per_sample=True)


# ------------------------------------------------------------------------------------------- shorthands
def test_strings_name_the_objects_where_unambiguous():
    assert as_solver("dopri5") == Adaptive("dopri5") and as_solver("bosh3") == Adaptive("bosh3")
    assert as_solver("rk4") == Fixed("rk4") and as_solver("euler") == Fixed("euler", step_size=None)
    assert as_solver("et") == EulerET(alpha=0.1, steps=12)
    assert as_gradient("direct") == Direct() and as_gradient("adjoint") == Adjoint()
    assert as_gradient("implicit") == Implicit()
    with pytest.raises(ValueError) as info:
        as_solver("rk45")
    assert all(name in str(info.value) for name in METHODS)
    with pytest.raises(ValueError, match="gradient"):
        as_gradient(Adaptive())  # a solver is not a gradient strategy


def test_a_string_solves_exactly_as_its_object():
    _, field, x0 = setup()
    t = torch.linspace(0.0, 1.0, 6, dtype=torch.float64)
    for name, settings in (("rk4", Fixed("rk4")), ("dopri5", Adaptive("dopri5"))):
        by_name, by_object = solve(field, x0, t, solver=name), solve(field, x0, t, solver=settings)
        assert torch.equal(by_name.xs, by_object.xs) and by_name.stats.nfe_forward == by_object.stats.nfe_forward
    assert torch.equal(solve(field, x0, solver="et").x, solve(field, x0, solver=EulerET()).x)


def test_solve_has_at_most_ten_parameters_and_no_mask():
    parameters = inspect.signature(solve).parameters
    assert len(parameters) <= 10 and "mask" not in parameters
    assert list(parameters) == ["field", "x0", "t", "solver", "gradient", "stop", "save", "max_steps", "progress"]


# ------------------------------------------------------------------------------------------- rules the objects own
def test_the_rules_between_arguments_are_methods_of_the_objects():
    x0 = torch.zeros(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="stop=SteadyState"):
        Implicit().check(None)
    Implicit().check(SteadyState(1e-3))
    with pytest.raises(ValueError, match="step_size"):
        Fixed("rk4").check_stop(SteadyState(1e-3))
    Fixed("rk4", step_size=0.1).check_stop(SteadyState(1e-3))
    with pytest.raises(ValueError, match="save='final'"):
        SteadyState(1e-3, per_sample=True).check(x0, "all")
    with pytest.raises(ValueError, match=r"\(batch, N, D\)"):
        SteadyState(1e-3, per_sample=True).check(x0[0], "final")
    SteadyState(1e-3, per_sample=True).check(x0, "final")
    with pytest.raises(ValueError, match="t=None"):
        EulerET().time_grid(torch.tensor([0.0, 1.0]), 1.0, x0.device, 100)
    with pytest.raises(ValueError, match="too coarse"):
        Adaptive().check_state(x0.half())
    EulerET().check_state(x0.half())
    # an Integration checks its objects' rules at construction
    with pytest.raises(ValueError, match="stop=SteadyState"):
        Integration(gradient="implicit")
    with pytest.raises(ValueError, match="step_size"):
        Integration(solver="rk4", stop=SteadyState(1e-3))


def test_the_field_holds_the_mask_and_the_solution_reads_it():
    _, field, x0 = setup()
    mask = torch.rand(4, 4, generator=torch.Generator().manual_seed(1)) < 0.6
    masked = solve(field.with_mask(mask), x0, (0.0, 1.0), save="final")
    assert masked.mask is mask and masked.field.mask is mask and field.mask is None
    reference = solve(ETField(field.model, tau=field.tau, mask=mask), x0, (0.0, 1.0), save="final")
    assert torch.equal(masked.x, reference.x)
    assert not torch.equal(masked.x, solve(field, x0, (0.0, 1.0), save="final").x)


# ------------------------------------------------------------------------------------------- the dispatcher
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fixed_steps_equal_a_hand_loop_bit_for_bit(dtype):
    _, field, x0 = setup(dtype=dtype)
    step = 0.07
    with torch.no_grad():
        solution = solve(field, x0, (0.0, 1.0), solver=Fixed("rk4", step_size=step), save="final")
    times = torch.arange(0, math.ceil(1.0 / step) + 1, dtype=torch.float64) * step
    times[-1] = 1.0  # torchdiffeq's step grid: steps of ``step`` ending exactly at t1
    assert torch.equal(solution.x, hand_rk4(field, x0, times))
    assert solution.stats.accepted_steps == len(times) - 1 and solution.stats.nfe_forward == 4 * (len(times) - 1)
    grid = torch.linspace(0.0, 1.0, 5, dtype=torch.float64)  # a fixed method without a step steps on t
    with torch.no_grad():
        on_grid = solve(field, x0, grid, solver="rk4")
    assert torch.equal(on_grid.x, hand_rk4(field, x0, grid))
    paper = solve(field, x0, solver=EulerET(alpha=0.05, steps=7))  # x <- x - alpha dE/dg, tau scales the time only
    x = x0.clone()
    with torch.no_grad():
        for _ in range(7):
            x = x + (0.05 * field.tau) * field.velocity(x)
    torch.testing.assert_close(paper.x.detach(), x, rtol=0, atol=10 * torch.finfo(dtype).eps)
    torch.testing.assert_close(paper.ts[-1].item(), 7 * 0.05 * field.tau)


def test_adaptive_solve_meets_its_tolerance_against_a_float64_reference():
    """dopri5 in float64 at rtol 1e-8 against a hand-written RK4 at 400 and 800 steps, Richardson-extrapolated
    (error ~1e-12 here); the same solve in float32 at rtol 1e-5 against the same reference."""
    model, field, x0 = setup(n=3)
    coarse, fine = (hand_rk4(field, x0, torch.linspace(0.0, 2.0, n + 1, dtype=torch.float64)) for n in (400, 800))
    reference = (16 * fine - coarse) / 15
    solution = solve(field, x0, (0.0, 2.0), solver=Adaptive(rtol=1e-8, atol=1e-10), save="final")
    error = float((solution.x.detach() - reference).abs().max())
    assert error < 100 * (1e-10 + 1e-8 * float(reference.abs().max())), error
    model32 = random_model(hopfield="softmax", seed=0, beta=0.7, eps=1e-3, dtype=torch.float32)
    single = solve(ETField(model32, tau=1.3), x0.float(), (0.0, 2.0), solver=Adaptive(rtol=1e-5, atol=1e-6))
    assert float((single.x.detach().double() - reference).abs().max()) < 1e-3


def test_saving_the_grid_with_a_stop_is_one_integration():
    """save="all" with a stop keeps the grid's states from the one integration (it solved twice before): the field is
    called only as often as the statistics say, about as often as without saving, and the saved states are the
    flow's at those times."""
    _, field, x0 = setup(n=1, batch=1)
    grid = torch.linspace(0.0, 1e3, 11, dtype=torch.float64)
    solver, stop = Adaptive(rtol=1e-9, atol=1e-11), SteadyState(1e-3)
    final = solve(field, x0, grid, solver=solver, stop=stop, save="final")
    before = field.nfe
    saved = solve(field, x0, grid, solver=solver, stop=stop)
    assert field.nfe - before == saved.stats.nfe_forward  # no evaluation the statistics do not count
    assert saved.status is Status.STEADY_STATE and 2 < len(saved.ts) < len(grid)
    assert saved.stats.nfe_forward < 1.5 * final.stats.nfe_forward, (saved.stats, final.stats)
    assert abs(saved.stats.t_final - final.stats.t_final) < 1e-3 * final.stats.t_final
    torch.testing.assert_close(saved.ts[:-1], grid[: len(saved.ts) - 1])
    reference = solve(field, x0, saved.ts[:-1], solver=Adaptive(rtol=1e-11, atol=1e-13))
    torch.testing.assert_close(saved.xs[:-1], reference.xs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(saved.xs[-1], saved.x.detach())


class _BrokenField(ETField):
    """A field whose evaluation raises the very errors, with torchdiffeq's texts, that torchdiffeq raises itself."""

    error: Exception = RuntimeError("Reached maximum number of iterations 20000.")

    def velocity(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def test_errors_raised_by_the_field_are_not_taken_for_torchdiffeq_failures():
    """torchdiffeq's failures are told by type and place (raised in torchdiffeq's code), not by message: the same
    texts raised by the field propagate unchanged, not as SolveError."""
    model, _, x0 = setup()
    for error in (RuntimeError("Reached maximum number of iterations 20000."), AssertionError("underflow in dt 0.0")):
        field = _BrokenField(model)
        field.error = error
        with pytest.raises(type(error), match=str(error).split()[0]) as info:
            solve(field, x0, (0.0, 1.0))
        assert not isinstance(info.value, SolveError)


@pytest.mark.slow
def test_torchdiffeq_event_loop_cap_is_a_solve_error():
    """torchdiffeq's own RuntimeError: its fixed-step event loop stops at 20000 steps, below our max_steps."""
    tiny = random_model(4, 1, 2, 3, hopfield="softmax", seed=5)
    x = torch.randn(1, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SolveError, match="torchdiffeq stopped") as caught:
        solve(
            ETField(tiny), x, (0.0, 2.5), solver=Fixed("euler", step_size=1e-4), stop=SteadyState(1e-300), max_steps=30_000
        )
    assert caught.value.solution is not None and caught.value.solution.status is Status.FAILED


def test_gradient_strategies_run_their_own_loops():
    model, field, x0 = setup(batch=1, n=1)
    stop = SteadyState(1e-3)
    implicit = solve(field, x0, (0.0, 1e4), gradient=Implicit(tol=1e-10), stop=stop, save="final")
    assert implicit.status is Status.STEADY_STATE and not implicit.x.requires_grad and implicit.g.requires_grad
    adjoint = solve(field, x0, (0.0, 1.0), gradient=Adjoint(rtol=1e-9, atol=1e-11), save="final")
    nfe = field.nfe
    adjoint.g.square().sum().backward()
    assert adjoint.stats.nfe_backward == field.nfe - nfe > 0  # the backward solve, counted on the public nfe
    with pytest.raises(SolveError, match="Implicit"):
        solve(field, x0, (0.0, 1e-3), gradient="implicit", stop=stop)


# ------------------------------------------------------------------------------------------- Integration
def test_integration_round_trips_as_plain_data_and_solves_as_solve():
    integration = Integration(
        solver=Fixed("midpoint", step_size=0.05),
        gradient=Adjoint(seminorm=True),
        stop=SteadyState(1e-2, measure="tangent_gradient"),
        t1=3.0,
        max_steps=500,
    )
    data = json.loads(json.dumps(integration.to_dict()))
    assert Integration.from_dict(data) == integration
    assert settings_from_dict(settings_to_dict(EulerET(0.2, 5))) == EulerET(0.2, 5)
    with pytest.raises(ValueError, match="kind"):
        settings_from_dict({"kind": "Magic"})
    assert data["kind"] == "Integration" and data["solver"]["kind"] == "Fixed"
    with pytest.raises(ValueError, match="kind 'Integration', got 'EulerET'"):
        Integration.from_dict(settings_to_dict(EulerET()))
    _, field, x0 = setup()
    paper = Integration(solver="et", gradient="direct")
    assert torch.equal(paper.solve(field, x0).x, solve(field, x0, solver=EulerET(), save="final").x)
    adaptive = Integration(t1=0.5)
    assert torch.equal(adaptive.solve(field, x0).x, solve(field, x0, (0.0, 0.5), save="final").x)


def test_time_and_saving_are_spelled_as_solve_spells_them():
    """``Integration.solve(field, x0, t, save)``: the times ``t`` (default ``(0, t1)``) and ``save`` with solve's
    default; ``answer`` is the end state a model reads."""
    assert inspect.signature(Integration.solve).parameters["save"].default == "all"
    assert inspect.signature(solve).parameters["save"].default == "all"
    _, field, x0 = setup()
    integration = Integration(Adaptive(rtol=1e-8, atol=1e-10), t1=0.5)
    whole = integration.solve(field, x0)
    assert whole.ts.tolist() == [0.0, 0.5] and whole.xs.shape == (2, *x0.shape)
    assert torch.equal(whole.xs[0], x0) and torch.equal(whole.xs[-1], whole.x)
    grid = integration.solve(field, x0, torch.linspace(0.0, 0.5, 4))
    reference = solve(field, x0, torch.linspace(0.0, 0.5, 4), solver=Adaptive(rtol=1e-8, atol=1e-10))
    assert torch.equal(grid.xs, reference.xs)
    answer = integration.answer(field, x0)
    assert answer.xs is None and torch.equal(answer.x, whole.x)
    paper = Integration(EulerET(0.1, 3))
    assert paper.solve(field, x0).xs.shape[0] == 4  # the scheme's own grid: every step saved
    with pytest.raises(ValueError, match="EulerET builds its grid"):
        paper.solve(field, x0, (0.0, 1.0))


def test_flat_options_become_the_objects():
    """What a command line or a grid search gives: one function turns it into the settings objects."""
    paper = Integration.from_options("et", step=0.2, steps=5)
    assert paper == Integration(solver=EulerET(0.2, 5), gradient=Direct())
    assert Integration.from_options("et").solver == EulerET()
    adaptive = Integration.from_options(
        "bosh3",
        t1=0.6,
        rtol=1e-2,
        atol=1e-3,
        gradient="adjoint",
        seminorm=True,
        adjoint_rtol=1e-3,
        steady_state=1e-4,
        max_steps=50,
    )
    assert adaptive == Integration(
        solver=Adaptive("bosh3", 1e-2, 1e-3),
        gradient=Adjoint(rtol=1e-3, seminorm=True),
        stop=SteadyState(1e-4),
        t1=0.6,
        max_steps=50,
    )
    assert Integration.from_options("rk4", step=0.05).solver == Fixed("rk4", step_size=0.05)
    assert Integration.from_options("implicit_adams").solver == Fixed("implicit_adams")
    with pytest.raises(ValueError, match="step is for fixed-step methods"):
        Integration.from_options("dopri5", step=0.1)
    with pytest.raises(ValueError, match="EulerET.alpha"):
        Integration.from_options("et", step=-1.0)
    with pytest.raises(ValueError, match="stop=SteadyState"):
        Integration.from_options("dopri5", gradient="implicit")
    with pytest.raises(ValueError, match="valid methods"):
        Integration.from_options("rk45")
