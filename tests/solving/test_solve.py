"""solve(): solvers against references, the paper's scheme, steady state, energy descent, failures."""

import importlib

import pytest
import torch
from torchdiffeq import odeint

from et_ode import (
    METHODS,
    Adaptive,
    Adjoint,
    ETField,
    EulerET,
    Fixed,
    GraphMask,
    Implicit,
    SolveError,
    Status,
    SteadyState,
    solve,
)
from tests.conftest import random_model


def setup(seed: int = 0, hopfield: str = "softmax", batch: int = 2, n: int = 4):
    model = random_model(hopfield=hopfield, seed=seed)
    x0 = torch.randn(batch, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return model, ETField(model), x0


def test_solution_shapes_and_statistics():
    model, field, x0 = setup()
    t = torch.linspace(0, 2, 5, dtype=torch.float64)
    solution = solve(field, x0, t)
    assert solution.xs.shape == (5, 2, 4, 8) and solution.energies.shape == (5, 2)
    assert torch.equal(solution.ts, t) and solution.status is Status.REACHED_END
    assert solution.stats.nfe_forward > 0 and solution.stats.accepted_steps > 0
    torch.testing.assert_close(solution.g, model.activation(solution.x))
    torch.testing.assert_close(solution.energies[-1], model.energy(solution.x).detach())
    torch.testing.assert_close(solution.residual, field.rms_dg_dt(solution.x).detach())


@pytest.mark.parametrize("method", ["dopri5", "bosh3", "adaptive_heun", "dopri8", "fehlberg2"])
def test_adaptive_solve_agrees_with_fine_fixed_step_reference(method):
    _, field, x0 = setup()
    t = (0.0, 1.5)
    reference = odeint(field, x0, torch.tensor(t, dtype=torch.float64), method="rk4", options={"step_size": 1e-3})[-1]
    rtol, atol = 1e-6, 1e-8
    solution = solve(field, x0, t, solver=Adaptive(method, rtol=rtol, atol=atol))
    error = (solution.x - reference).abs().max()
    assert float(error) < 100 * (atol + rtol * float(reference.abs().max()))


# explicit Adams (high order, small stability region) is unstable on this field above a step of about 0.003
@pytest.mark.parametrize(
    "method, step",
    [("euler", 0.02), ("midpoint", 0.02), ("rk4", 0.02), ("explicit_adams", 0.0025), ("implicit_adams", 0.02)],
)
def test_fixed_step_methods_converge_to_the_reference(method, step):
    _, field, x0 = setup()
    reference = solve(field, x0, (0.0, 1.0), solver=Adaptive("dopri8", rtol=1e-12, atol=1e-13)).x
    coarse = (solve(field, x0, (0.0, 1.0), solver=Fixed(method, step_size=step)).x - reference).abs().max()
    fine = (solve(field, x0, (0.0, 1.0), solver=Fixed(method, step_size=step / 2)).x - reference).abs().max()
    assert float(fine) < float(coarse) < 1e-1  # converges as the step shrinks


def test_paper_scheme_equals_hand_written_euler_loop_exactly():
    model, field, x0 = setup(hopfield="relu")
    alpha, steps = 0.1, 12
    solution = solve(field, x0, solver=EulerET(alpha, steps))
    x, paper = x0.clone(), x0.clone()
    with torch.no_grad():
        for t0, t1 in zip(solution.ts[:-1], solution.ts[1:]):
            x = x + (t1 - t0) * field(t0, x)
            paper = paper - alpha * model.dE_dg(model.activation(paper))
    assert torch.equal(solution.x.detach(), x)
    torch.testing.assert_close(solution.x.detach(), paper, rtol=1e-13, atol=1e-13)
    assert solution.stats.accepted_steps == steps and solution.stats.nfe_forward == steps
    assert len(solution.ts) == steps + 1


@pytest.mark.parametrize("seed, method", list(enumerate(["dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun"])))
def test_energy_is_non_increasing_along_adaptive_trajectories(seed, method):
    for run_seed in (seed, seed + 10):
        model, field, x0 = setup(seed=run_seed, hopfield="relu", batch=3)
        rtol = 1e-6 if method in ("dopri5", "dopri8") else 1e-5  # low orders need many steps at tight rtol
        solution = solve(field, x0, (0.0, 5.0), solver=Adaptive(method, rtol=rtol, atol=1e-8), save="steps")
        rises = solution.energies[1:] - solution.energies[:-1]
        assert float(rises.max()) <= rtol * float(solution.energies.abs().max())
        assert solution.xs.shape[0] == solution.stats.accepted_steps + 1


def test_steady_state_stops_early_below_tolerance_with_finite_difference_gradients():
    torch.manual_seed(0)
    model, field, x0 = setup(n=1, batch=1)
    tol = 1e-3
    solution = solve(field, x0, (0.0, 1e3), stop=SteadyState(tol), solver=Adaptive(rtol=1e-10, atol=1e-12))
    assert solution.status is Status.STEADY_STATE
    assert solution.stats.t_final < 1e3
    assert float(solution.residual.max()) <= tol * (1 + 1e-6)
    assert float(solution.residual.max()) >= 0.5 * tol  # stopped at the crossing, not long after

    target = torch.randn_like(x0)

    def loss(scale: torch.Tensor) -> torch.Tensor:
        out = solve(
            field, x0 * scale, (0.0, 1e3), stop=SteadyState(tol), solver=Adaptive(rtol=1e-10, atol=1e-12), save="final"
        )
        return ((out.g - target) ** 2).sum()

    scale = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(loss(scale), scale)
    h = 1e-4
    fd = (loss(torch.tensor(1 + h, dtype=torch.float64)) - loss(torch.tensor(1 - h, dtype=torch.float64))) / (2 * h)
    assert torch.isfinite(grad)
    assert abs(float(grad) - float(fd)) <= 1e-3 * max(abs(float(fd)), 1e-3)


@pytest.mark.parametrize(
    "method, measure, tol, per_sample",
    [
        ("dopri5", "dg_dt", 1e-3, False),
        ("bosh3", "dg_dt", 1e-3, True),
        ("dopri5", "tangent_gradient", 0.1, False),
        ("et", "dg_dt", 1e-2, False),
    ],
)
def test_steady_state_test_and_solver_share_evaluations_at_the_same_state(monkeypatch, method, measure, tol, per_sample):
    """torchdiffeq's loop: the stop test reads the recorder's latest evaluation (et-ode's loop tests the velocity its
    step ends with by construction)."""
    integrate_module = importlib.import_module("et_ode.integrators.loop")
    _, field, x0 = setup(batch=3)
    kwargs = dict(stop=SteadyState(tol, measure=measure, per_sample=per_sample), save="final")
    solver = EulerET(0.1, 3000) if method == "et" else Adaptive(method, loop="torchdiffeq")
    kwargs.update(dict(solver=solver) if method == "et" else dict(t=(0.0, 1e3), solver=solver))
    shared = solve(field, x0, **kwargs)

    def always_evaluate(self, x, t=None):
        self.progress.sample_evaluations += x.shape[:-2].numel()
        return self.field(t, x)

    monkeypatch.setattr(integrate_module.Recorder, "velocity", always_evaluate)
    fresh = solve(field, x0, **kwargs)
    assert shared.status is Status.STEADY_STATE and fresh.status is Status.STEADY_STATE
    torch.testing.assert_close(shared.stats.stop_times, fresh.stats.stop_times, rtol=0, atol=0)
    torch.testing.assert_close(shared.x, fresh.x, rtol=0, atol=0)  # the same decisions, bit for bit
    # dopri5 and bosh3 end each step with the field at the new state, which the test reads; an Euler step
    # starts from the state the test has just evaluated: at least one evaluation saved per step
    saved = fresh.stats.nfe_forward - shared.stats.nfe_forward
    assert saved >= shared.stats.accepted_steps > 10, (saved, shared.stats)
    samples_saved = fresh.stats.sample_evaluations - shared.stats.sample_evaluations
    assert saved * (1 if per_sample else 3) <= samples_saved <= saved * 3  # per sample: the batch shrinks


def test_steady_state_saves_grid_up_to_the_stop():
    _, field, x0 = setup(n=1, batch=1)
    t = torch.linspace(0, 1e3, 11, dtype=torch.float64)
    solution = solve(field, x0, t, stop=SteadyState(1e-3), solver=Adaptive(rtol=1e-9, atol=1e-11))
    assert solution.status is Status.STEADY_STATE
    assert solution.xs.shape[0] == len(solution.ts) and solution.ts[-1] == solution.stats.t_final
    assert bool((solution.ts[:-1] < solution.stats.t_final).all())
    torch.testing.assert_close(solution.xs[-1], solution.x.detach())


def test_steady_state_not_reached_reports_reached_end():
    _, field, x0 = setup()
    solution = solve(field, x0, (0.0, 0.5), stop=SteadyState(1e-12))
    assert solution.status is Status.REACHED_END
    assert abs(solution.stats.t_final - 0.5) < 1e-5


def test_unknown_method_lists_the_valid_ones():
    _, field, x0 = setup()
    with pytest.raises(ValueError) as info:
        solve(field, x0, (0.0, 1.0), solver="rk45")
    for name in METHODS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(t=(1.0, 0.0)), "increasing"),
        (dict(t=(0.0,)), "at least 2"),
        (dict(t=None), "t is required"),
        (dict(t=(0.0, 1.0), gradient="magic"), "gradient"),
        (dict(t=(0.0, 1.0), gradient="implicit"), "stop=SteadyState"),
        (dict(t=(0.0, 1.0), gradient=Implicit()), "stop=SteadyState"),
        (dict(t=(0.0, 1.0), save="some"), "save"),
        (dict(t=(0.0, 1.0), max_steps=0), "max_steps"),
        (dict(t=(0.0, 1.0), solver="rk4", stop=SteadyState(1e-3)), "step_size"),
        (dict(t=torch.tensor([0.0, 1.0]), solver=EulerET()), "t=None"),
        (dict(t=(0.0, 1.0), stop=SteadyState(1e-3, per_sample=True)), "per_sample"),
    ],
)
def test_bad_arguments_are_named(kwargs, word):
    _, field, x0 = setup()
    with pytest.raises(ValueError, match=word):
        solve(field, x0, **kwargs)


def test_bad_state_is_rejected_before_solving():
    _, field, x0 = setup()
    with pytest.raises(ValueError, match="x0"):
        solve(field, x0[..., :5], (0.0, 1.0))
    with pytest.raises(ValueError, match="non-finite"):
        solve(field, x0 * torch.nan, (0.0, 1.0))


def test_max_steps_raises_with_partial_solution():
    _, field, x0 = setup()
    with pytest.raises(SolveError, match="max_steps=5") as info:
        solve(field, x0, (0.0, 100.0), max_steps=5)
    partial = info.value.solution
    assert partial.status is Status.FAILED and partial.stats.accepted_steps == 5
    assert 0 < info.value.time < 100 and partial.x.shape == x0.shape


def test_step_underflow_raises_solve_error():
    _, field, x0 = setup()
    with pytest.raises(SolveError, match="underflow") as info:
        solve(field, x0, (1e17, 1e17 + 100.0))
    assert info.value.solution is not None


def test_non_finite_state_raises_solve_error():
    _, field, x0 = setup()
    with pytest.raises(SolveError, match="non-finite") as info:
        solve(field, x0, torch.tensor([0.0, 1e308, 1.5e308], dtype=torch.float64), solver="euler")  # x overflows
    assert info.value.solution.status is Status.FAILED


def test_per_sample_stopping_matches_solving_each_sample_alone():
    model = random_model(hopfield="softmax")
    field = ETField(model)
    scales = torch.tensor([0.2, 1.0, 5.0], dtype=torch.float64)[:, None, None]
    x0 = torch.randn(3, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * scales
    tol, options = 1e-3, dict(solver=Adaptive(rtol=1e-9, atol=1e-11), save="final")
    together = solve(field, x0, (0.0, 1e4), stop=SteadyState(tol, per_sample=True), **options)
    assert together.status is Status.STEADY_STATE
    assert bool((together.residual <= tol * (1 + 1e-6)).all()) and bool((together.residual >= 0.5 * tol).all())
    stops = together.stats.stop_times
    assert len(set(stops.tolist())) == 3
    for i in range(3):
        alone = solve(field, x0[i : i + 1], (0.0, 1e4), stop=SteadyState(tol), **options)
        assert abs(alone.stats.t_final - float(stops[i])) <= 1e-3 * float(stops[i])
        torch.testing.assert_close(together.x[i], alone.x[0], rtol=1e-4, atol=1e-4)
    assert together.stats.sample_evaluations < 3 * together.stats.nfe_forward


def test_per_sample_stopping_is_differentiable_with_the_adjoint():
    model = random_model(hopfield="softmax")
    x0 = torch.randn(3, 3, 8, dtype=torch.float64) * torch.tensor([0.3, 1.0, 3.0], dtype=torch.float64)[:, None, None]
    solution = solve(
        ETField(model), x0, (0.0, 1e4), stop=SteadyState(1e-3, per_sample=True), save="final", gradient=Adjoint()
    )
    solution.g.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="per_sample"):
        solve(ETField(model), x0, (0.0, 1.0), stop=SteadyState(1e-3, per_sample=True))  # save="all"


def test_tangent_gradient_measure_stops_on_the_energy_gradient_along_the_spheres():
    from et_ode.dynamics.manifold import radial_direction, tangent_projection

    model = random_model(hopfield="softmax", seed=2)
    field = ETField(model)
    x0 = torch.randn(2, 1, 8, dtype=torch.float64)
    solution = solve(
        field, x0, (0.0, 1e6), stop=SteadyState(1e-2, measure="tangent_gradient"), solver=Adaptive(rtol=1e-9, atol=1e-11)
    )
    assert solution.status is Status.STEADY_STATE
    g = solution.g.detach()
    s, _ = radial_direction(g, model.neuron.delta.detach())
    tangent = tangent_projection(model.dE_dg(g), s).square().mean(dim=(-1, -2)).sqrt()
    assert float(tangent.max()) <= 1e-2 * (1 + 1e-6)


def test_per_sample_stop_on_a_graph_mask():
    """A GraphMask (shared by the batch) with per-sample stopping: each sample stops where its own RMS dg/dt reaches
    the tolerance, as when it is solved alone."""
    model = random_model(seed=4)
    field = ETField(model, mask=GraphMask(torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 2]]), 5))
    x0 = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    settings = dict(solver=Adaptive(rtol=1e-8, atol=1e-10), stop=SteadyState(1e-3, per_sample=True), save="final")
    out = solve(field, x0, (0.0, 100.0), **settings)
    assert out.stats.stop_times is not None and bool((out.stats.stop_times < 100.0).all())
    assert torch.allclose(field.rms_dg_dt(out.x), torch.full((2,), 1e-3, dtype=torch.float64), rtol=1e-4)
    for b in range(2):
        alone = solve(field, x0[b : b + 1], (0.0, 100.0), **settings)
        assert torch.allclose(alone.stats.stop_times, out.stats.stop_times[b : b + 1], rtol=1e-6)
