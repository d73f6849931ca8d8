"""et-ode's own adaptive Runge-Kutta loop (et_ode.integrators.adaptive_loop) and its settings on ``Adaptive``: order against
analytic solutions, agreement with torchdiffeq, per-sample step control (batch-composition independence,
compaction), dense output, direct gradients against finite differences (the adjoint's: test_adaptive_adjoint.py),
progress, bad arguments."""

from __future__ import annotations

import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pytest
import torch
from torchdiffeq import odeint

import et_ode
from et_ode.integrators import adaptive_loop
from et_ode.integrators.solution import Progress
from et_ode.integrators.solvers import SolverFailure, as_solver
from et_ode.kernels import native
from tests.conftest import counted_backend, random_model

F64 = torch.float64
StepControl = Literal["shared", "per_sample"]
Compile = bool | Literal["auto"]


def _rotation(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear field ``dx/dt = x S`` with ``S`` skew-symmetric (the exact flow is ``x0 expm(S t)``), and ``x0``."""
    generator = torch.Generator().manual_seed(seed)
    s = torch.randn(4, 4, dtype=F64, generator=generator)
    return s - s.T, torch.randn(2, 3, 4, dtype=F64, generator=generator)


def _smooth_model(seed: int = 0) -> et_ode.EnergyTransformer:
    """A tiny model with a smooth energy (softplus memories: ReLU's kinks spoil step control and the orders)."""
    return random_model(seed=seed, hopfield="softplus", beta_hn=2.5)


def _tiny_field(seed: int = 0) -> et_ode.ETField:
    return et_ode.ETField(_smooth_model(seed))


def _recorder(into: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A progress callback that keeps what it is told: each sample's time and accepted steps."""
    return lambda t, accepted: into.append((t, accepted))


def _states(batch: int, seed: int = 3, tokens: int = 5) -> torch.Tensor:
    """Samples of growing scale (some easy, some hard for the step control): ``(batch, tokens, 8)``."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.3, 3.0, batch, dtype=F64)[:, None, None]
    return torch.randn(batch, tokens, 8, dtype=F64, generator=generator) * scales


# -- order and accuracy ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "h", "solution_ratio", "dense_ratio"),
    [("dopri5", 0.1, 64, 32), ("tsit5", 0.05, 64, 32), ("bosh3", 0.1, 16, 16)],
)
def test_one_step_errors_shrink_at_the_method_orders(method: str, h: float, solution_ratio: int, dense_ratio: int) -> None:
    """One step of ``h`` on a linear ODE: the local error of the solution is O(h^(p+1)) (dopri5 and tsit5 p=5, bosh3
    p=3), and the interpolant at ``h/2`` O(h^5) (dopri5's quartic, tsit5's own) or O(h^4) (bosh3's Hermite cubic):
    halving ``h`` divides them by those powers of 2, measured against the exact flow."""
    s, x0 = _rotation()

    def errors(h: float) -> tuple[float, float]:
        grid = torch.tensor([0.0, h / 2, h], dtype=F64)  # tolerances so loose that the one step of h is accepted
        x, xs, _ = adaptive_loop.integrate(lambda t, x: x @ s, x0, grid, method=method, rtol=1e3, atol=1e3, first_step=h)
        assert xs is not None and torch.equal(xs[-1], x)
        return (
            (x - x0 @ torch.linalg.matrix_exp(s * h)).abs().max().item(),
            (xs[1] - x0 @ torch.linalg.matrix_exp(s * h / 2)).abs().max().item(),
        )

    (end_h, mid_h), (end_half, mid_half) = errors(h), errors(h / 2)
    assert solution_ratio * 0.8 < end_h / end_half < solution_ratio * 1.25
    assert dense_ratio * 0.8 < mid_h / mid_half < dense_ratio * 1.25


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("method", ["dopri5", "tsit5", "bosh3"])
def test_global_error_follows_the_tolerance(method: str, per_sample: bool) -> None:
    """Over many steps on the linear ODE, the states at the output times (interpolated) are within a small multiple
    of the tolerance of the exact flow, and tightening the tolerance 100-fold shrinks the error at least 20-fold."""
    s, x0 = _rotation(1)
    grid = torch.linspace(0, 4, 17, dtype=F64)
    exact = torch.stack([x0 @ torch.linalg.matrix_exp(s * t) for t in grid])
    errors = []
    for tol in (1e-5, 1e-7):
        _, xs, _ = adaptive_loop.integrate(
            lambda t, x: x @ s, x0, grid, method=method, rtol=tol, atol=tol, per_sample=per_sample
        )
        assert xs is not None
        errors.append((xs - exact).abs().max().item())
    assert errors[0] < 50 * 1e-5 and errors[1] < 50 * 1e-7
    assert errors[0] / errors[1] > 20


@pytest.mark.parametrize("compile", [False, "auto"])  # (step by step; the native loop where it runs)
def test_dense_output_on_the_et_field_matches_a_tight_reference(compile: Compile) -> None:
    """States at 41 output times (most inside steps), against torchdiffeq's dopri5 at rtol=atol=1e-12: no further
    from it than the solve's own step ends are (the global error), nor than torchdiffeq at the same tolerance; and
    saving costs no evaluations (the same solve saving only the end takes as
    many, to the same bits)."""
    field = _tiny_field()
    x0 = _states(2)
    grid = torch.linspace(0, 1.5, 31, dtype=F64)
    solver = et_ode.Adaptive(rtol=1e-8, atol=1e-8, loop="et_ode", compile=compile)
    with torch.no_grad():
        reference = odeint(field, x0, grid, method="dopri5", rtol=1e-12, atol=1e-12)
        theirs = odeint(field, x0, grid, method="dopri5", rtol=1e-8, atol=1e-8)
        dense = et_ode.solve(field, x0, grid, solver=solver)
        end = et_ode.solve(field, x0, grid, solver=solver, save="final")
        steps = et_ode.solve(field, x0, grid, solver=solver, save="steps")
        assert steps.xs is not None and len(steps.ts) > 15
        at_steps = odeint(field, x0, steps.ts, method="dopri5", rtol=1e-12, atol=1e-12)
    assert dense.xs is not None
    dense_error = (dense.xs - reference).abs().max().item()
    assert dense_error <= 1.5 * (steps.xs - at_steps).abs().max().item()
    assert dense_error <= 1.5 * (theirs - reference).abs().max().item()
    assert dense.stats.nfe_forward == end.stats.nfe_forward
    assert torch.equal(dense.x, end.x)


@pytest.mark.parametrize("compile", [False, "auto"])  # (step by step; the native loop where it runs)
@pytest.mark.parametrize("step_control", ["per_sample", "shared"])
def test_agrees_with_torchdiffeq_dopri5_on_the_et_field(step_control: StepControl, compile: Compile) -> None:
    """On a tiny ET field, et-ode's dopri5 and torchdiffeq's at the same tolerances both land within their tolerance
    of a tight reference; shared step control takes about as many evaluations as torchdiffeq."""
    field = _tiny_field(1)
    x0 = _states(4, seed=5)
    grid = torch.tensor([0.0, 3.0], dtype=F64)
    with torch.no_grad():
        reference = odeint(field, x0, grid, method="dopri5", rtol=1e-12, atol=1e-12)[-1]
        theirs_nfe = field.nfe
        theirs = odeint(field, x0, grid, method="dopri5", rtol=1e-7, atol=1e-9)[-1]
        theirs_nfe = field.nfe - theirs_nfe
        ours = et_ode.solve(
            field, x0, grid, solver=et_ode.Adaptive(rtol=1e-7, atol=1e-9, step_control=step_control, compile=compile)
        )
    scale = reference.abs().max().item()
    assert (theirs - reference).abs().max().item() < 1e-5 * scale
    assert (ours.x - reference).abs().max().item() < 1e-5 * scale
    if step_control == "shared":
        assert 0.8 * theirs_nfe <= ours.stats.nfe_forward <= 1.25 * theirs_nfe


def test_pid_controller_is_accurate_and_steps_differently() -> None:
    """diffrax's PID form (pcoeff 0.4, icoeff 0.3) reaches the same accuracy on the linear ODE with another step
    sequence than the I-controller."""
    s, x0 = _rotation(2)
    grid = torch.tensor([0.0, 5.0], dtype=F64)
    exact = x0 @ torch.linalg.matrix_exp(s * 5.0)
    counts = []
    for pid in (adaptive_loop.I_CONTROLLER, adaptive_loop.PID_COEFFICIENTS):
        progress = Progress()
        x, _, _ = adaptive_loop.integrate(
            lambda t, x: x @ s, x0, grid, rtol=1e-7, atol=1e-7, pid=pid, progress=progress, save_all=False
        )
        assert (x - exact).abs().max().item() < 50 * 1e-7
        counts.append((progress.accepted, progress.rejected))
    assert counts[0] != counts[1]


# -- per-sample step control -------------------------------------------------------------------------------------
def _per_sample_evaluation(field: et_ode.ETField):  # type: ignore[no-untyped-def]
    """The field evaluated one sample at a time: no batched BLAS call whose blocking depends on the batch size."""
    return lambda t, x: torch.cat([field.velocity(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("indices", [[2], [0, 5, 8], [7, 2], [8, 6, 4, 1, 0]])
def test_a_sample_steps_the_same_bits_alone_and_in_any_batch(indices: list[int]) -> None:
    """float64, the field evaluated per sample: a sample's saved and final states are bit for bit those it has
    alone, inside the full batch and inside any other batch (in any order), with and without gradients."""
    evaluate = _per_sample_evaluation(_tiny_field())
    x0 = _states(9)
    grid = torch.linspace(0, 2, 6, dtype=F64)
    with torch.no_grad():
        x, xs, _ = adaptive_loop.integrate(evaluate, x0, grid, rtol=1e-6, atol=1e-8)
        part, part_xs, _ = adaptive_loop.integrate(evaluate, x0[indices], grid, rtol=1e-6, atol=1e-8)
    assert xs is not None and part_xs is not None
    assert torch.equal(part, x[indices]) and torch.equal(part_xs, xs[:, indices])
    alone = [
        adaptive_loop.integrate(
            evaluate, x0[i : i + 1].clone().requires_grad_(True), grid, rtol=1e-6, atol=1e-8, save_all=False
        )[0]
        for i in indices[:1]
    ]
    assert torch.equal(alone[0].detach(), x[indices[:1]])


@pytest.mark.parametrize("method,pid", [("tsit5", adaptive_loop.I_CONTROLLER), ("dopri5", adaptive_loop.PID_COEFFICIENTS)])
def test_the_same_bits_with_tsit5_s_interpolant_and_the_pid_controller(method: str, pid: tuple[float, float, float]) -> None:
    """tsit5's own interpolant and the PID terms also give a sample the states it has in any batch, bit for bit."""
    evaluate = _per_sample_evaluation(_tiny_field())
    x0, indices = _states(9), [8, 6, 4, 1, 0]
    grid = torch.linspace(0, 2, 6, dtype=F64)
    with torch.no_grad():
        x, xs, _ = adaptive_loop.integrate(evaluate, x0, grid, method=method, pid=pid, rtol=1e-6, atol=1e-8)
        part, part_xs, _ = adaptive_loop.integrate(evaluate, x0[indices], grid, method=method, pid=pid, rtol=1e-6, atol=1e-8)
    assert xs is not None and part_xs is not None
    assert torch.equal(part, x[indices]) and torch.equal(part_xs, xs[:, indices])


def test_the_controller_s_power_does_not_depend_on_an_element_s_place() -> None:
    """Where an element sits in the tensor (the vectorised body or the scalar tail of the CPU loop) does not change
    its power (a plain ``**`` differs in the last bit for about 1 element in 64, on AVX-512 and on AVX2)."""
    base = torch.rand(256, generator=torch.Generator().manual_seed(0), dtype=F64) * 3 + 1e-3
    for exponent in (-0.2, 0.2, -0.14):
        whole = adaptive_loop._power(base, exponent)
        alone = [adaptive_loop._power(base[i : i + 1], exponent)[0] for i in range(len(base))]
        assert torch.equal(whole, torch.stack(alone))
        assert torch.allclose(whole, base**exponent, rtol=1e-15, atol=0)


@pytest.mark.parametrize("compile", [False, "auto"])  # (step by step; the native loop where it runs)
def test_batch_composition_independence_through_solve_on_the_batched_et_field(compile: Compile) -> None:
    """Through ``solve`` with the ET field's batched products, whose last bits depend on the batch size (measured:
    up to 9e-15 on one evaluation), a sample's states alone and in other batches agree to 1e-11 of their scale
    (measured: 8e-13); shared step control, by contrast, moves a sample by far more when its batch changes."""
    field = _tiny_field()
    x0 = _states(12)
    grid = torch.linspace(0, 2, 5, dtype=F64)
    per_sample = et_ode.Adaptive(rtol=1e-6, atol=1e-8, step_control="per_sample", compile=compile)
    shared = et_ode.Adaptive(rtol=1e-6, atol=1e-8, loop="et_ode", compile=compile)
    with torch.no_grad():
        full = et_ode.solve(field, x0, grid, solver=per_sample)
        full_shared = et_ode.solve(field, x0, grid, solver=shared)
        assert full.xs is not None and full_shared.xs is not None
        scale = full.xs.abs().max().item()
        for indices in ([0], [11], [1, 4, 9], [10, 2, 6, 7]):
            part = et_ode.solve(field, x0[indices], grid, solver=per_sample)
            assert part.xs is not None
            assert (part.xs - full.xs[:, indices]).abs().max().item() < 1e-11 * scale
        alone_shared = et_ode.solve(field, x0[:1], grid, solver=shared)
    assert (alone_shared.x - full_shared.x[:1]).abs().max().item() > 1e-9 * scale


@pytest.mark.parametrize("compile", [False, "auto"])  # (step by step; the native loop where it runs)
def test_compaction_spends_evaluations_on_the_hard_samples_only(compile: Compile) -> None:
    """A batch of two samples already at rest and two far from it: the per-sample mode lets the easy ones finish in
    few long steps and leave, so its sample-evaluations fall below the shared mode's (which steps everyone as the
    hardest sample), at the same accuracy."""
    field = _tiny_field()
    hard = _states(2, seed=7) * 3
    with torch.no_grad():
        easy = et_ode.solve(
            field, _states(2, seed=8), (0.0, 40.0), solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9), save="final"
        ).x
        x0 = torch.cat([easy, hard])
        grid = torch.tensor([0.0, 2.0], dtype=F64)
        runs = {
            mode: et_ode.solve(
                field,
                x0,
                grid,
                save="final",
                solver=et_ode.Adaptive(rtol=1e-6, atol=1e-8, step_control=mode, compile=compile),
            )
            for mode in ("per_sample", "shared")
        }
        reference = odeint(field, x0, grid, method="dopri5", rtol=1e-11, atol=1e-11)[-1]
    per_sample, shared = runs["per_sample"].stats, runs["shared"].stats
    assert per_sample.sample_evaluations < 0.8 * shared.sample_evaluations
    assert shared.sample_evaluations == 4 * shared.nfe_forward
    for run in runs.values():
        assert (run.x - reference).abs().max().item() < 1e-6 * reference.abs().max().item()


def test_per_sample_masks_follow_their_samples_through_compaction() -> None:
    """A mask per sample ``(B, N, N)``: as samples leave the batch the field is bound to the remaining ones' masks,
    so every sample ends where it ends alone with its own mask."""
    field = _tiny_field()
    x0 = _states(4, tokens=4)
    generator = torch.Generator().manual_seed(0)
    masks = torch.rand(4, 4, 4, generator=generator) > 0.4
    masks |= torch.eye(4, dtype=torch.bool)
    solver = et_ode.Adaptive(rtol=1e-6, atol=1e-8, step_control="per_sample")
    with torch.no_grad():
        batch = et_ode.solve(field.with_mask(masks), x0, (0.0, 1.5), solver=solver, save="final")
        for i in range(4):
            alone = et_ode.solve(field.with_mask(masks[i : i + 1]), x0[i : i + 1], (0.0, 1.5), solver=solver, save="final")
            assert (alone.x - batch.x[i : i + 1]).abs().max().item() < 1e-10


def test_per_sample_masks_hold_where_a_stop_locates_its_crossing() -> None:
    """A per-sample stop inside a batch with a mask per sample: the crossing search evaluates the field at the
    crossing samples alone, each with its own mask, so every sample stops where it stops alone."""
    field = _tiny_field()
    x0 = _mixed_batch(field)
    generator = torch.Generator().manual_seed(1)
    n = x0.shape[-2]
    masks = (torch.rand(len(x0), n, n, generator=generator) > 0.4) | torch.eye(n, dtype=torch.bool)
    solver = et_ode.Adaptive(rtol=1e-6, atol=1e-8, step_control="per_sample")
    stop = et_ode.SteadyState(1e-3, per_sample=True)
    with torch.no_grad():
        batch = et_ode.solve(field.with_mask(masks), x0, (0.0, 100.0), solver=solver, stop=stop, save="final")
        assert batch.stats.stop_times is not None and int((batch.stats.stop_times < 100.0).sum()) >= 2
        for i in range(len(x0)):
            alone = et_ode.solve(
                field.with_mask(masks[i : i + 1]), x0[i : i + 1], (0.0, 100.0), solver=solver, stop=stop, save="final"
            )
            assert alone.stats.stop_times is not None
            assert abs(float(alone.stats.stop_times[0]) - float(batch.stats.stop_times[i])) < 1e-9
            assert (alone.x - batch.x[i : i + 1]).abs().max().item() < 1e-10


# -- gradients -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("step_control", ["per_sample", "shared"])
def test_direct_gradients_match_central_differences_of_the_whole_solve(step_control: StepControl) -> None:
    """float64: the gradient of a loss of the saved states through the loop (stages, compaction, interpolant) in a
    random direction of ``x0`` and of every parameter matches central finite differences of the whole solve to 1e-7
    (measured: 2e-10 to 1e-9; the step sizes move with the perturbation there, by far less at these tolerances, and
    the energy is smooth: with ReLU memories the kinks make the whole solve's differences noisy, 5e-5 measured)."""
    model = _smooth_model(4)
    field = et_ode.ETField(model)
    x0 = _states(2, seed=9, tokens=3)
    grid = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
    solver = et_ode.Adaptive(rtol=1e-10, atol=1e-10, step_control=step_control, loop="et_ode")
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(3, *x0.shape, dtype=F64, generator=generator)
    direction_x = torch.randn(x0.shape, dtype=F64, generator=generator)
    params = [p for p in model.parameters() if p.requires_grad]
    directions = [torch.randn(p.shape, dtype=F64, generator=generator) for p in params]

    def loss(x: torch.Tensor) -> torch.Tensor:
        solution = et_ode.solve(field, x, grid, solver=solver)
        assert solution.xs is not None
        return (solution.xs * weights).sum()

    analytic, numeric = _directional_derivatives(loss, x0, direction_x, params, directions, eps=1e-5)
    assert abs(analytic - numeric) < 1e-7 * max(1.0, abs(numeric))


# -- progress, failures, arguments -------------------------------------------------------------------------------
def test_progress_reports_each_sample_time_and_accepted_steps() -> None:
    """The callback sees every sample's time (non-decreasing, ending at t1) and accepted steps; their total is
    ``stats.accepted_steps``; one call per batched step."""
    field = _tiny_field()
    x0 = _states(3)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    solver = et_ode.Adaptive(step_control="per_sample", progress=_recorder(calls))
    with torch.no_grad():
        solution = et_ode.solve(field, x0, (0.0, 2.0), solver=solver, save="final")
    times = torch.stack([t for t, _ in calls])
    assert times.shape == (len(calls), 3) and bool((times[1:] >= times[:-1]).all())
    assert torch.equal(times[-1], torch.full((3,), 2.0, dtype=F64))
    assert int(calls[-1][1].sum()) == solution.stats.accepted_steps
    counts = torch.stack([n for _, n in calls])
    assert bool((counts[1:] >= counts[:-1]).all()) and len(calls) >= int(counts[-1].max())
    assert bool(((counts[1:] - counts[:-1]) <= 1).all())  # at most one accepted step per sample per call


@pytest.mark.parametrize("per_sample", [False, True])
def test_the_time_reached_follows_the_earliest_sample_to_the_end(per_sample: bool) -> None:
    """The loop tells its counter (``solve``'s progress bar) the earliest time its samples have reached after every
    step: non-decreasing, below the end while a sample still runs, and the end at last."""
    reached: list[float] = []

    class Recording(Progress):
        def reached(self, t: float) -> None:
            reached.append(t)

    progress = Recording()
    with torch.no_grad():
        adaptive_loop.integrate(
            _tiny_field(), _states(3), torch.tensor([0.0, 3.0], dtype=F64), per_sample=per_sample, progress=progress
        )
    assert len(reached) == progress.steps and reached[-1] == 3.0
    assert all(b >= a for a, b in zip(reached, reached[1:])) and reached[-2] < 3.0


def test_step_budget_failure_keeps_the_partial_solution() -> None:
    field = _tiny_field()
    x0 = _states(3)
    with pytest.raises(et_ode.SolveError, match="max_steps=3") as caught:
        et_ode.solve(field, x0, (0.0, 50.0), solver=et_ode.Adaptive(step_control="per_sample"), max_steps=3)
    partial = caught.value.solution
    assert partial is not None and partial.status is et_ode.Status.FAILED and partial.x.shape == x0.shape
    with pytest.raises(SolverFailure, match="underflow"):
        adaptive_loop.integrate(lambda t, x: x * 1e300, x0.clone(), torch.tensor([0.0, 1.0], dtype=F64), first_step=1e-300)
    progress = Progress()
    with pytest.raises(SolverFailure, match="non-finite"):  # at the first step, not after shrinking it to nothing
        adaptive_loop.integrate(field, x0.clone().fill_(math.nan), torch.tensor([0.0, 1.0], dtype=F64), progress=progress)
    assert progress.steps == 1


def test_the_own_loop_is_the_default_for_its_methods_where_it_runs_the_solve() -> None:
    """``loop="auto"``: et-ode's loop for dopri5, bosh3 and tsit5; torchdiffeq for its other methods and options,
    for a stop it cannot pair with the step control or save through, and for an adjoint's backward method of its
    own; settings only et-ode's loop has take it whatever the stop."""
    own, per_sample = et_ode.Adaptive(), et_ode.Adaptive(step_control="per_sample")
    assert own.own_loop() and as_solver("dopri5").own_loop() and et_ode.Adaptive("bosh3").own_loop()  # type: ignore[union-attr]
    assert et_ode.Adaptive("tsit5").requires_own_loop and per_sample.requires_own_loop and not own.requires_own_loop
    assert not et_ode.Adaptive(loop="torchdiffeq").own_loop() and not et_ode.Adaptive("dopri8").own_loop()
    assert not et_ode.Adaptive(options=dict(max_num_steps=50)).own_loop()
    assert own.own_loop(et_ode.SteadyState(1e-3)) and not own.own_loop(et_ode.SteadyState(1e-3), save="all")
    assert not own.own_loop(et_ode.SteadyState(1e-3, per_sample=True))
    assert per_sample.own_loop(et_ode.SteadyState(1e-3, per_sample=True))
    assert not own.own_loop(backward_method="dopri8") and own.own_loop(backward_method="bosh3")
    for compile in ("auto", False):  # (a setting of et-ode's loop only where it compiles)
        assert not et_ode.Adaptive(loop="torchdiffeq", compile=compile).own_loop()


@pytest.mark.parametrize(
    ("arguments", "error", "named"),
    [
        (dict(loop="fast"), ValueError, "Adaptive.loop"),
        (dict(step_control="each"), ValueError, "Adaptive.step_control"),
        (dict(controller="pi"), ValueError, "Adaptive.controller"),
        (dict(loop="torchdiffeq", step_control="per_sample"), ValueError, "step_control='per_sample' needs loop"),
        (dict(loop="torchdiffeq", controller="pid"), ValueError, "controller='pid' needs loop"),
        (dict(method="dopri8", loop="et_ode"), ValueError, "Adaptive.method"),
        (dict(method="tsit5", loop="torchdiffeq"), ValueError, "method='tsit5' needs loop"),
        (dict(method="rk45"), ValueError, "Adaptive.method"),
        (dict(loop="et_ode", options=dict(max_num_steps=5)), ValueError, "Adaptive.options"),
        (dict(progress=3), TypeError, "Adaptive.progress"),
        (dict(cuda_graph=1), TypeError, "Adaptive.cuda_graph"),
        (dict(loop="torchdiffeq", cuda_graph=True), ValueError, "cuda_graph=True needs loop"),
        (dict(method="dopri8", cuda_graph=True), ValueError, "Adaptive.method"),
        (dict(compile="yes"), TypeError, "Adaptive.compile"),
        (dict(compile=1), TypeError, "Adaptive.compile must be a bool or 'auto'"),
        (dict(loop="torchdiffeq", compile=True), ValueError, "compile=True needs loop"),
        (dict(cuda_graph=True, compile=True), ValueError, "cuda_graph=True and compile=True"),
    ],
)
def test_bad_settings_are_named(arguments: dict[str, object], error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named.replace("(", r"\(")):
        et_ode.Adaptive(**arguments)  # type: ignore[arg-type]


def test_bad_combinations_with_solve_are_named() -> None:
    field = _tiny_field()
    x0 = _states(2)
    with pytest.raises(ValueError, match="save='steps'"):
        et_ode.solve(field, x0, (0.0, 1.0), solver=et_ode.Adaptive(step_control="per_sample"), save="steps")
    with pytest.raises(ValueError, match="pid"):
        adaptive_loop.integrate(field, x0, torch.tensor([0.0, 1.0], dtype=F64), pid=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="method"):
        adaptive_loop.integrate(field, x0, torch.tensor([0.0, 1.0], dtype=F64), method="rk4")


@pytest.mark.parametrize("compile", [False, "auto"])  # (step by step; the native loop where it runs)
def test_shared_mode_saves_every_step_and_float32_runs(compile: Compile) -> None:
    """``save="steps"`` with shared control keeps the start of every accepted step and the end; float32 states
    integrate to within float32 tolerances of the float64 solve."""
    field = _tiny_field()
    x0 = _states(2)
    with torch.no_grad():
        steps = et_ode.solve(field, x0, (0.0, 1.0), solver=et_ode.Adaptive(loop="et_ode", compile=compile), save="steps")
        assert steps.xs is not None and len(steps.ts) == steps.stats.accepted_steps + 1
        assert torch.equal(steps.xs[0], x0) and bool((steps.ts[1:] > steps.ts[:-1]).all())
        field32 = et_ode.ETField(_smooth_model().float())
        single = et_ode.solve(
            field32, x0.float(), (0.0, 1.0), solver=et_ode.Adaptive(step_control="per_sample", compile=compile), save="final"
        )
    assert (single.x.double() - steps.x).abs().max().item() < 1e-3


# -- a captured step -----------------------------------------------------------------------------------------------
def _graph_runs(graph: str | None, **settings: object) -> tuple[adaptive_loop.Result, Progress, int]:
    """A solve of ``_states(batch)`` (4 by default) with shared control (``per_sample=True``: per sample)."""
    field = et_ode.ETField(_smooth_model(), mask=settings.pop("mask", None))  # type: ignore[arg-type]
    progress = Progress()
    grid = torch.linspace(0.0, 3.0, 7, dtype=F64)
    x0 = _states(int(settings.pop("batch", 4)), seed=int(settings.pop("seed", 3)))  # type: ignore[call-overload]
    with torch.no_grad():
        result = adaptive_loop.integrate(
            field,
            x0,
            grid,
            per_sample=bool(settings.pop("per_sample", False)),
            progress=progress,
            graph=graph,
            **settings,  # type: ignore[arg-type]
        )
    return result, progress, field.nfe


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # every step accepted: the state buffers are copied, not traded
        dict(first_step=2.0, save_all=False),  # rejected steps: the state stays, the replay reads it again
        dict(mask=torch.rand(4, 5, 5, generator=torch.Generator().manual_seed(1)) < 0.7, method="tsit5"),
        dict(keep_steps=True, save_all=False, pid=adaptive_loop.PID_COEFFICIENTS),
        # a single sample's own steps, its own mask, rejected steps
        dict(per_sample=True, batch=1, seed=5, first_step=2.0, mask=torch.tensor([[[True, False, True, True, False]] * 5])),
    ],
)
def test_a_replayed_step_integrates_the_same_bits_as_the_plain_loop(settings: dict[str, object]) -> None:
    """The discipline of a CUDA graph (fixed inputs copied in, the first attempt's outputs overwritten, the state
    buffers never trading places), run eagerly: the same states, saved outputs, steps and evaluations."""
    plain, plain_progress, plain_nfe = _graph_runs(None, **dict(settings))
    replayed, progress, nfe = _graph_runs("eager", **dict(settings))
    assert progress.steps > adaptive_loop.WARM_STEPS + 2 and plain_progress.rejected == progress.rejected
    assert torch.equal(plain.x, replayed.x)
    assert (plain.xs is None) == (replayed.xs is None) and (plain.xs is None or torch.equal(plain.xs, replayed.xs))
    assert [a for a, _ in plain_progress.saved] == [a for a, _ in progress.saved]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain_progress.saved, progress.saved, strict=True))
    assert (plain_progress.accepted, plain_progress.sample_evaluations, plain_nfe) == (
        progress.accepted,
        progress.sample_evaluations,
        nfe,
    )
    if settings.get("first_step"):
        assert progress.rejected > 0


def test_a_step_that_cannot_be_captured_leaves_the_solve_as_without(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*_: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    plain, plain_progress, plain_nfe = _graph_runs(None)
    monkeypatch.setattr(adaptive_loop._StepGraph, "__init__", fails)
    with pytest.warns(RuntimeWarning, match=r"cuda_graph=True.*not permitted"):
        fallback, progress, nfe = _graph_runs("eager")
    assert torch.equal(plain.x, fallback.x) and (plain_progress.sample_evaluations, plain_nfe) == (
        progress.sample_evaluations,
        nfe,
    )


def test_each_solve_captures_its_step_even_on_a_shared_progress_record(monkeypatch: pytest.MonkeyPatch) -> None:
    captures: list[int] = []
    capture = adaptive_loop._StepGraph.__init__

    def counted(self: adaptive_loop._StepGraph, loop: adaptive_loop._Loop, *rest: object) -> None:
        captures.append(loop.progress.steps)
        capture(self, loop, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(adaptive_loop._StepGraph, "__init__", counted)
    progress = Progress()
    grid = torch.linspace(0.0, 3.0, 7, dtype=F64)
    with torch.no_grad():
        for _ in range(2):
            adaptive_loop.integrate(_tiny_field(), _states(4), grid, per_sample=False, progress=progress, graph="eager")
    first_solve_steps = captures[1] - captures[0] if len(captures) == 2 else None
    assert len(captures) == 2 and captures[0] == adaptive_loop.WARM_STEPS + 1
    assert first_solve_steps == progress.steps // 2  # the second solve captured at its own third step


def test_a_step_is_captured_only_where_it_can_be_replayed() -> None:
    field = _tiny_field()
    grid = torch.tensor([0.0, 1.0], dtype=F64)
    cases = [  # (settings, captured): a batch's own steps or a stop are not; a single sample's steps are one group's
        (dict(per_sample=True), False),
        (dict(per_sample=False, stop=lambda x, f: x.new_ones(1)), False),
        (dict(per_sample=True, batch=1), True),
    ]
    for settings, captured in cases:
        with torch.no_grad():  # (with gradients no step is captured)
            loop = adaptive_loop._Loop(
                field,
                _states(int(settings.pop("batch", 2))),  # type: ignore[call-overload]
                grid,
                adaptive_loop.DOPRI5,
                1e-5,
                1e-6,
                pid=adaptive_loop.I_CONTROLLER,
                max_steps=10,
                progress=Progress(),
                callback=None,
                graph="eager",
                **settings,  # type: ignore[arg-type]
            )
        assert loop.graph_mode == ("eager" if captured else None)
    with pytest.raises(ValueError, match="graph must be"):
        adaptive_loop.integrate(field, _states(2), grid, graph="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_graph_replays_the_steps_of_the_plain_loop() -> None:
    """On CUDA: ``Adaptive(cuda_graph=True)`` gives the same bits, steps and evaluations as the plain loop."""
    field = et_ode.ETField(_smooth_model().cuda())
    x0 = _states(4).cuda()
    with torch.no_grad():
        runs = [
            et_ode.solve(field, x0, torch.linspace(0.0, 3.0, 7, dtype=F64), solver=et_ode.Adaptive(cuda_graph=graph))
            for graph in (False, True)
        ]
    assert runs[1].stats.accepted_steps > adaptive_loop.WARM_STEPS + 2
    assert torch.equal(runs[0].x, runs[1].x) and torch.equal(runs[0].xs, runs[1].xs)
    assert (runs[0].stats.nfe_forward, runs[0].stats.sample_evaluations) == (
        runs[1].stats.nfe_forward,
        runs[1].stats.sample_evaluations,
    )


# -- the compiled solve --------------------------------------------------------------------------------------------
def _compiled_and_plain(
    field: et_ode.ETField, x0: torch.Tensor, save: str = "all", bar: bool = False, **settings: object
) -> list[et_ode.Solution]:
    """The solves of ``x0`` with ``compile=True`` and without (``bar``: a progress bar shown), to t = 3."""
    grid = torch.linspace(0.0, 3.0, 7, dtype=F64)
    with torch.no_grad():
        return [
            et_ode.solve(field, x0, grid, solver=et_ode.Adaptive(compile=compiled, **settings), save=save, progress=bar)  # type: ignore[arg-type]
            for compiled in (True, False)
        ]


Watcher = Literal["callback", "bar"] | None  # what watches a solve's progress
Engine = Literal["native", "inductor"]  # what runs compile=True's whole solve


def _check_compiled_solves(
    step_control: StepControl = "shared",
    batch: int = 3,
    save: str = "all",
    first_step: float | None = 2.0,
    watched: Watcher = None,
    engine: Engine = "inductor",
) -> None:
    """``Adaptive(compile=True)`` at a non-default tau, a mask (on ``torch.compile``; the native loop takes none), the
    PID controller and a first step too large (rejected steps; None: the loop's choice), ``watched`` by a progress
    callback, a progress bar or nothing: the same steps, evaluations and float64 states to rounding as the plain loop;
    after the weights change in place, the next compiled solve follows the new weights (nothing of the old ones is
    kept as a constant)."""
    model = _smooth_model(seed=4)
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(2)) < 0.7
    field = et_ode.ETField(model, tau=0.7, mask=mask if engine == "inductor" else None)
    x0 = _states(batch)
    options = None if first_step is None else dict(first_step=first_step)
    settings = dict(controller="pid", options=options, rtol=1e-7, atol=1e-9, step_control=step_control)
    if watched == "callback":
        settings["progress"] = lambda t, x: None
    for scale in (1.0, 1.3):
        with torch.no_grad():
            model.hopfield.xi.mul_(scale)
        compiled, plain = _compiled_and_plain(field, x0, save, watched == "bar", **settings)
        assert compiled.stats.accepted_steps > 3 and (compiled.stats.rejected_steps > 0 or first_step is None)
        for stat in ("accepted_steps", "rejected_steps", "nfe_forward"):
            assert getattr(compiled.stats, stat) == getattr(plain.stats, stat), stat
        if engine == "inductor":  # every sample at every evaluation (the plain loop's finished samples leave the batch)
            assert compiled.stats.sample_evaluations == compiled.stats.nfe_forward * batch >= plain.stats.sample_evaluations
        else:  # (the native loop evaluates the samples still running only)
            assert compiled.stats.sample_evaluations == plain.stats.sample_evaluations
        assert (compiled.x - plain.x).abs().max().item() < 1e-12
        if save == "all":
            assert (compiled.xs - plain.xs).abs().max().item() < 1e-12
    assert (x0 - plain.x).abs().max().item() > 1e-2  # the states moved


def _engine(monkeypatch: pytest.MonkeyPatch, engine: Engine = "inductor") -> dict[str, list[object]]:
    """``compile=True``'s whole solve on ``engine``: ``"native"``, the C loop (skipped where this machine cannot build
    it), or ``"inductor"``, what is handed to ``torch.compile`` run as it is (no compiler: its ``while_loop`` runs
    eagerly; the native loop off). Returns the calls ("solve"), each call's budget of steps ("budgets") and PyTorch's
    thread count during each ("threads")."""
    handed: dict[str, list[object]] = {"solve": [], "threads": [], "budgets": []}

    def recorded(run: Callable[..., object]) -> Callable[..., object]:
        def call(solve: object, *arguments: object) -> object:
            handed["solve"].append(solve)
            handed["threads"].append(torch.get_num_threads())
            handed["budgets"].append(int(arguments[6]))  # type: ignore[call-overload]
            return run(solve, *arguments)

        return call

    if engine == "native":
        if not native.can_build():
            pytest.skip("the native solve cannot be built here (no C compiler or no BLAS in PyTorch)")
        assert native.library(F64) is not None, "a compiler and a BLAS are here: the build or its probe failed"
        monkeypatch.setattr(native.NativeSolve, "__call__", recorded(native.NativeSolve.__call__))
        return handed
    _without_native(monkeypatch)
    monkeypatch.setattr(adaptive_loop, "_compiled_solve", lambda device_type: recorded(adaptive_loop._whole_solve))
    return handed


def _without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile=True`` hands every solve to ``torch.compile`` (the native loop off)."""
    monkeypatch.setattr(native.NativeSolve, "create", classmethod(lambda cls, *arguments, **settings: None))


SAVES_FIRST_STEPS_AND_WATCHED: list[tuple[str, float | None, Watcher]] = [
    ("all", 2.0, None),
    ("all", 2.0, "callback"),
    ("all", 2.0, "bar"),
    ("final", 2.0, None),
    ("final", None, None),
    ("final", None, "bar"),
]


@pytest.mark.parametrize(("step_control", "batch"), [("shared", 3), ("per_sample", 1), ("per_sample", 3)])
@pytest.mark.parametrize(("save", "first_step", "watched"), SAVES_FIRST_STEPS_AND_WATCHED)
@pytest.mark.parametrize(("engine", "chunk"), [("inductor", 0.0), ("native", 0.0), ("native", 1e6)])
def test_a_compiled_solve_integrates_the_field(
    monkeypatch: pytest.MonkeyPatch,
    step_control: StepControl,
    batch: int,
    save: str,
    first_step: float | None,
    watched: Watcher,
    engine: Engine,
    chunk: float,
) -> None:
    """``compile=True`` for shared steps and each sample's own: the whole solve as one loop on the field's closed
    form, which writes the states at the saved times itself, in calls (a step each, or all steps in one after a first
    call of one step), each going on from the last one's end, its evaluations counted by hand; on the native loop (the
    C code itself), or as handed to ``torch.compile``, run as it is (the compiler itself is the slow test's: minutes
    on a cold cache). The plain loop would agree too, so what ran is checked."""
    handed = _engine(monkeypatch, engine)
    monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", chunk)
    _check_compiled_solves(step_control, batch, save, first_step, watched, engine)
    assert len(handed["solve"]) > (8 if chunk == 0.0 else 1)


_ATTEMPT = adaptive_loop._Loop.attempt  # (the loop's own, whatever a test puts in its place)


def _watched(
    monkeypatch: pytest.MonkeyPatch,
    compiled: bool,
    step_control: StepControl,
    save: str,
    max_steps: int,
    poisoned: float | None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], et_ode.Solution | str]:
    """What a progress callback got from a solve of three samples to t = 3, and the solution or the message of its
    failure: the budget of ``max_steps`` spent, or (``poisoned``: every state a step from that time on reaches is NaN)
    the next step's non-finite state."""

    def attempt(loop: adaptive_loop._Loop, t: torch.Tensor, *arguments: object) -> adaptive_loop._Attempt:
        result = _ATTEMPT(loop, t, *arguments)  # type: ignore[arg-type]
        if poisoned is not None:  # (in place: the plain loop's state lives in its buffers)
            result.y1.copy_(torch.where((t >= poisoned)[:, None, None], math.nan, result.y1))
        return result

    monkeypatch.setattr(adaptive_loop._Loop, "attempt", attempt)
    reports: list[tuple[torch.Tensor, torch.Tensor]] = []
    solver = et_ode.Adaptive(compile=compiled, step_control=step_control, progress=_recorder(reports))
    try:
        with torch.no_grad():
            solution = et_ode.solve(_tiny_field(), _states(3), (0.0, 3.0), solver=solver, save=save, max_steps=max_steps)
        return reports, solution
    except et_ode.SolveError as error:
        return reports, str(error).split(" at t=")[0]


@pytest.mark.parametrize("engine", ["inductor", "native"])
@pytest.mark.parametrize("step_control", ["shared", "per_sample"])
def test_a_compiled_solve_reports_and_keeps_every_step_as_the_loop(
    monkeypatch: pytest.MonkeyPatch, step_control: StepControl, engine: Engine
) -> None:
    """Watched by a progress callback, the compiled solve logs each step's times inside its calls (here of
    ``LOGGED_STEPS = 5`` steps) and calls the callback after each call for each of its steps: the plain loop's times
    and accepted steps (exactly) after each of the same steps, up to a failure too (the budget of steps spent, or a
    non-finite state inside a call). Shared and keeping every step's state (``save="steps"``: a step a call), the
    states kept are the plain loop's (to the rounding of the field's closed form, which the compiled solve
    evaluates)."""
    handed = _engine(monkeypatch, engine)
    logged = 5
    monkeypatch.setattr(adaptive_loop, "LOGGED_STEPS", logged)
    monkeypatch.setattr(adaptive_loop, "_steps_per_call", lambda kind: 10**6)
    cases = [("final", 10_000, None), ("final", 7, None)]
    cases += [("final", 10_000, 1.0)] if engine == "inductor" else []  # (the poison is put in the Python loop's step)
    for save, max_steps, poisoned in cases + ([("steps", 10_000, None)] if step_control == "shared" else []):
        handed["solve"].clear()
        (reports, compiled), (plain_reports, plain) = (
            _watched(monkeypatch, on, step_control, save, max_steps, poisoned) for on in (True, False)
        )
        steps = len(reports) + (poisoned is not None)  # (a failed step is not reported)
        assert len(handed["solve"]) == (steps if save == "steps" else -(-steps // logged))
        assert poisoned is None or len(reports) % logged  # (the failed step comes after others in its call)
        assert len(reports) == len(plain_reports) > 5 and int(reports[-1][1].min()) > 3
        for (t, accepted), (t_plain, accepted_plain) in zip(reports, plain_reports, strict=True):
            torch.testing.assert_close(t, t_plain, rtol=1e-9, atol=0.0)  # (the closed form's rounding moves the steps)
            assert torch.equal(accepted, accepted_plain)
        if isinstance(compiled, str) or isinstance(plain, str):
            failure = "the state became non-finite" if poisoned else f"max_steps={max_steps} solver steps exceeded"
            assert compiled == plain and failure in compiled, (compiled, plain)
        elif save == "steps":
            torch.testing.assert_close(compiled.ts, plain.ts, rtol=1e-9, atol=0.0)
            torch.testing.assert_close(compiled.xs, plain.xs, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["inductor", "native"])
def test_a_compiled_solve_s_calls_take_about_chunk_seconds_of_steps(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """The first call of a kind of solve takes one step (it may compile), the next as many as fit in
    ``CHUNK_SECONDS`` at the last call's time a step; a later solve of the same kind starts from that time (here all
    its steps in one call), one of another kind (another batch, or weights of other shapes) from one step again."""
    budgets = _engine(monkeypatch, engine)["budgets"]
    monkeypatch.setattr(adaptive_loop, "_STEP_SECONDS", {})
    monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", 1e6)
    field, solver = _tiny_field(), et_ode.Adaptive(compile=True)

    def solved(batch: int, field: et_ode.ETField = field) -> list[int]:
        budgets.clear()
        with torch.no_grad():
            solution = et_ode.solve(field, _states(batch), (0.0, 3.0), solver=solver, save="final", max_steps=500)
        assert solution.stats.accepted_steps > 4
        return list(budgets)

    assert solved(2) == [1, 499]
    assert solved(2) == [500]
    assert solved(3) == [1, 499]
    more_memories = et_ode.ETField(random_model(memories=20, hopfield="softplus", beta_hn=2.5))
    assert solved(3, more_memories) == [1, 499]
    kinds = list(adaptive_loop._STEP_SECONDS)
    monkeypatch.setattr(adaptive_loop, "_STEP_SECONDS", dict.fromkeys(kinds, 0.1))
    monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", 0.35)
    assert solved(3)[0] == 3


@pytest.mark.parametrize("engine", ["inductor", "native"])
@pytest.mark.parametrize("bar", [True, False])
@pytest.mark.parametrize("step_control", ["shared", "per_sample"])
def test_a_compiled_solve_moves_its_bar_between_calls_where_an_interrupt_lands(
    monkeypatch: pytest.MonkeyPatch, step_control: StepControl, bar: bool, engine: Engine
) -> None:
    """The whole solve runs in calls (here a step each), with or without a progress bar: the time reached, which the
    bar follows, is the earliest sample's after every call, up to the end; an interrupt raised between two calls
    (Ctrl-C lands there: the Python between them is where its handler runs) ends the solve there, with PyTorch's
    thread count set back."""
    handed = _engine(monkeypatch, engine)
    monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", 0.0)
    reached: list[float] = []
    monkeypatch.setattr(Progress, "reached", lambda progress, t: reached.append(t))
    field, x0 = _tiny_field(), _states(3)
    solver = et_ode.Adaptive(compile=True, step_control=step_control)
    with torch.no_grad():
        et_ode.solve(field, x0, (0.0, 3.0), solver=solver, save="final", progress=bar)
    assert len(handed["solve"]) == len(reached) > 4
    assert reached == sorted(reached) and reached[-1] == 3.0 and reached[0] > 0.0

    def interrupted(progress: Progress, t: float) -> None:
        if len(handed["solve"]) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "reached", interrupted)
    handed["solve"].clear()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # (the calls run on one: a small state)
        with torch.no_grad(), pytest.raises(KeyboardInterrupt):
            et_ode.solve(field, x0, (0.0, 3.0), solver=solver, save="final", progress=bar)
        assert len(handed["solve"]) == 3 and set(handed["threads"][-3:]) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_compiled_solve_is_traced_once_for_new_states_and_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo traces the whole solve of an unmasked field (whose attention builds its diagonal inside the compiled code)
    once: later solves from other states, after the weights change in place, reuse it (its back end here runs the traced
    graph as it is: no C++ compiler), with the first step chosen inside the first call or given, with a progress bar
    or without, and so do the calls of each solve (here a step each), each from the last one's end; each solve agrees
    with the uncompiled loop."""
    _without_native(monkeypatch)
    counted, graphs = counted_backend()
    traced = torch.compile(adaptive_loop._whole_solve, backend=counted, dynamic=False)
    monkeypatch.setattr(adaptive_loop, "_compiled_solve", lambda device_type: traced)
    monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", 0.0)
    field = _tiny_field()
    for seed, bar, first_step in [(3, False, None), (5, True, None), (7, False, 0.05), (9, True, 0.05)]:
        with torch.no_grad():
            field.model.hopfield.xi.mul_(1.1)
        options = None if first_step is None else dict(first_step=first_step)
        compiled, plain = _compiled_and_plain(field, _states(2, seed=seed), "final", bar, options=options)
        assert compiled.stats.nfe_forward == plain.stats.nfe_forward
        torch.testing.assert_close(compiled.x, plain.x, rtol=1e-10, atol=1e-12)
    assert len(graphs) == 1


class _Bar:
    """What the loop asks of a progress bar: its count ``n`` and ``update``."""

    def __init__(self) -> None:
        self.n = 0.0

    def update(self, by: float) -> None:
        self.n += by


@pytest.mark.parametrize("engine", ["inductor", "native"])
@pytest.mark.parametrize("bar", [False, True])
def test_a_compiled_solve_fails_where_the_loop_fails(monkeypatch: pytest.MonkeyPatch, bar: bool, engine: Engine) -> None:
    """The whole solve compiled (in calls of a step each; ``bar``: with a progress bar) keeps the step-by-step loop's
    failures: the budget of steps (with the state it got to), a non-finite state at the first step, a step size that
    underflows."""
    handed = _engine(monkeypatch, engine)
    monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", 0.0)

    def record() -> Progress:
        return Progress(bar=_Bar() if bar else None)

    field, x0 = _tiny_field(), _states(2)
    grid = torch.tensor([0.0, 50.0], dtype=F64)
    ends = []
    for graph in ("compile", None):
        progress = record()
        with torch.no_grad(), pytest.raises(SolverFailure, match="max_steps=6") as caught:
            settings = dict(per_sample=False, save_all=False, max_steps=6, graph=graph, progress=progress)
            adaptive_loop.integrate(field, x0, grid, **settings)  # type: ignore[arg-type]
        assert progress.last is not None
        ends.append((caught.value.time, progress.steps, progress.accepted, progress.last[1]))
    assert ends[0][1:3] == ends[1][1:3] and math.isclose(ends[0][0], ends[1][0], rel_tol=1e-12)
    assert (ends[0][3] - ends[1][3]).abs().max().item() < 1e-11 and (ends[0][3] - x0).abs().max().item() > 1e-3
    progress = record()
    with torch.no_grad(), pytest.raises(SolverFailure, match="non-finite"):
        adaptive_loop.integrate(field, x0.clone().fill_(math.nan), grid, save_all=False, graph="compile", progress=progress)
    assert progress.steps == 1
    late = torch.tensor([1.0, 2.0], dtype=F64)  # (1 + 1e-300 is 1)
    with torch.no_grad(), pytest.raises(SolverFailure, match="underflow"):
        settings = dict(per_sample=False, save_all=False, first_step=1e-300, graph="compile", progress=record())
        adaptive_loop.integrate(field, x0, late, **settings)  # type: ignore[arg-type]
    assert len(handed["solve"]) > 6  # (all on the engine)


@pytest.mark.parametrize("engine", ["inductor", "native"])
@pytest.mark.parametrize(("each_step", "batch", "threads"), [(True, 51, 1), (True, 103, 2), (True, 300, 3), (False, 51, 1)])
def test_compiled_code_runs_on_one_thread_per_2048_state_elements(
    monkeypatch: pytest.MonkeyPatch, each_step: bool, batch: int, threads: int, engine: Engine
) -> None:
    """Out of 3 threads, a compiled solve of ``batch * 40`` state elements (``each_step``: keeping every step's state,
    a step a call) runs on ``elements // 2048`` of them (at least one); the process's count is set back after the
    solve, and after a failed one."""
    handed = _engine(monkeypatch, engine)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        monkeypatch.setattr(adaptive_loop, "CHUNK_SECONDS", 1e6)  # (else: one call, after a first step's)
        solver = et_ode.Adaptive(compile=True, step_control="shared")
        save = "steps" if each_step else "final"
        with torch.no_grad():
            solution = et_ode.solve(_tiny_field(), _states(batch), (0.0, 1.0), solver=solver, save=save)
        assert handed["threads"] and set(handed["threads"]) == {threads}
        steps = solution.stats.accepted_steps + solution.stats.rejected_steps
        assert (len(handed["solve"]) == steps > 2) if each_step else (len(handed["solve"]) <= 2)
        assert torch.get_num_threads() == 3
        with torch.no_grad(), pytest.raises(et_ode.SolveError, match="max_steps=2"):
            et_ode.solve(_tiny_field(), _states(batch), (0.0, 50.0), solver=solver, save="final", max_steps=2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def _on_one_and_three_threads(x0: torch.Tensor, solver: et_ode.Adaptive) -> list[et_ode.Solution]:
    """The solves of ``x0`` to t = 3 (5 saved times) with ``solver`` on one thread and on three, without gradients."""
    field, grid, before = _tiny_field(), torch.linspace(0.0, 3.0, 5, dtype=F64), torch.get_num_threads()
    solutions = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            with torch.no_grad():
                solutions.append(et_ode.solve(field, x0, grid, solver=solver))
    finally:
        torch.set_num_threads(before)
    return solutions


def test_the_native_loop_steps_the_samples_on_several_threads_to_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per sample, the native loop's samples step on the process's threads (each sample on one): on 3 threads the
    same states at every saved time, bit for bit, as on one, and the same evaluations."""
    handed = _engine(monkeypatch, "native")
    monkeypatch.setattr(native.NativeSolve, "__call__", _handed_threads(native.NativeSolve.__call__, handed))
    x0 = _states(7)
    solutions = _on_one_and_three_threads(x0, et_ode.Adaptive(compile=True, step_control="per_sample"))
    assert torch.equal(solutions[0].xs, solutions[1].xs) and (solutions[0].xs[-1] - x0).abs().max() > 1e-2
    assert solutions[0].stats.sample_evaluations == solutions[1].stats.sample_evaluations
    assert {1, 3} <= set(handed["teams"])


def test_the_native_loop_s_shared_passes_run_on_the_batch_s_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared, the native loop's one group has its passes between the products on as many threads as its products
    (one per 2048 state elements): 3 for 160 samples of 5 tokens of 8 out of 3 threads, one out of one; the states at
    every saved time agree to 1e-12 (the products' sums may differ with their threads), with the same steps."""
    _engine(monkeypatch, "native")
    handed: list[int] = []
    described = native.NativeSolve._field
    recorded = lambda solve, threads: handed.append(threads) or described(solve, threads)  # noqa: E731
    monkeypatch.setattr(native.NativeSolve, "_field", recorded)
    x0 = _states(160)
    solutions = _on_one_and_three_threads(x0, et_ode.Adaptive(compile=True))
    assert set(handed) == {1, 3}
    assert float((solutions[0].xs - solutions[1].xs).abs().max()) < 1e-12 * float(x0.abs().max())
    assert solutions[0].stats.accepted_steps == solutions[1].stats.accepted_steps


@pytest.mark.usefixtures("fresh_library")
def test_the_native_loop_built_without_openmp_steps_the_same(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the compiler has no OpenMP the native loop is built without it: the samples then step one after another
    on 3 threads too, to the same bits as the loop built with it."""
    _engine(monkeypatch, "native")
    field, x0, before = _tiny_field(), _states(5), torch.get_num_threads()
    solver, grid = et_ode.Adaptive(compile=True, step_control="per_sample"), torch.linspace(0.0, 3.0, 5, dtype=F64)
    solutions = []
    try:
        torch.set_num_threads(3)
        for openmp in (native.OPENMP, ()):
            monkeypatch.setattr(native, "OPENMP", openmp)
            monkeypatch.setenv("ET_ODE_CACHE", str(tmp_path / str(len(openmp))))
            native.library.cache_clear()
            with torch.no_grad():
                solutions.append(et_ode.solve(field, x0, grid, solver=solver))
    finally:
        torch.set_num_threads(before)
    assert [path.name.split("_")[2] for path in sorted(tmp_path.glob("*/native/*.so"))] == ["double", "double"]
    assert torch.equal(solutions[0].xs, solutions[1].xs)


@pytest.mark.parametrize("step_control", ["shared", "per_sample"])
def test_compile_auto_runs_a_solve_in_the_native_loop_where_it_computes_the_field(
    monkeypatch: pytest.MonkeyPatch, step_control: StepControl
) -> None:
    """The default ``compile="auto"``: a solve without gradients of a field the native loop computes runs there (the
    same steps, evaluations and float64 states to 1e-12 as step by step, ``compile=False``); with a progress
    callback, gradients, a mask or another energy it runs step by step, never handed to ``torch.compile``."""
    handed = _engine(monkeypatch, "native")
    monkeypatch.setattr(adaptive_loop, "_compiled_solve", lambda device_type: pytest.fail("torch.compile was asked"))
    field, x0, grid = _tiny_field(), _states(3), torch.linspace(0.0, 3.0, 4, dtype=F64)

    def solved(field: et_ode.ETField, x0: torch.Tensor, **settings: object) -> tuple[et_ode.Solution, int]:
        before = len(handed["solve"])
        solver = et_ode.Adaptive(rtol=1e-7, atol=1e-9, step_control=step_control, **settings)  # type: ignore[arg-type]
        return et_ode.solve(field, x0, grid, solver=solver), len(handed["solve"]) - before

    with torch.no_grad():
        (auto, calls), (plain, none) = solved(field, x0), solved(field, x0, compile=False)
        assert calls >= 1 and none == 0 and auto.xs is not None and plain.xs is not None
        for stat in ("accepted_steps", "rejected_steps", "nfe_forward", "sample_evaluations"):
            assert getattr(auto.stats, stat) == getattr(plain.stats, stat), stat
        assert float((auto.xs - plain.xs).abs().max()) < 1e-12 < float((plain.x - x0).abs().max())
        assert solved(field, x0, progress=lambda t, accepted: None)[1] == 0
        assert solved(field.with_mask(torch.eye(5, dtype=torch.bool).logical_not()), x0)[1] == 0
        hopfield_only = et_ode.EnergyModel(field.model.neuron, {"hopfield": field.model.hopfield})
        assert solved(et_ode.ETField(hopfield_only), x0)[1] == 0
    assert solved(field, x0.clone().requires_grad_())[1] == 0


def _handed_threads(call: Callable[..., object], handed: dict[str, list[object]]) -> Callable[..., object]:
    """``NativeSolve.__call__`` recording the threads each call may use (into ``handed["teams"]``)."""

    def recorded(solve: native.NativeSolve, *arguments: object) -> object:
        handed.setdefault("teams", []).append(min(int(arguments[-1]), solve.threads))  # type: ignore[call-overload]
        return call(solve, *arguments)

    return recorded


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(name) for name in ("c++", "g++", "clang++")), reason="torch.compile needs a C++ compiler"
)
@pytest.mark.parametrize(
    ("step_control", "save", "first_step", "watched"),
    [("shared", *case) for case in SAVES_FIRST_STEPS_AND_WATCHED] + [("per_sample", "all", 2.0, None)],
)
def test_a_compiled_solve_integrates_the_plain_loop_s_solution(
    step_control: StepControl, save: str, first_step: float | None, watched: Watcher
) -> None:
    with warnings.catch_warnings():  # compiled for real: the uncompiled fallback would agree too
        warnings.filterwarnings("error", message=".*could not be compiled")
        _check_compiled_solves(step_control, 3, save, first_step, watched)


@pytest.mark.parametrize(
    ("save", "error", "bar"),
    [
        ("all", RuntimeError("no C++ compiler"), False),
        ("final", RuntimeError("no C++ compiler"), False),
        ("final", RuntimeError("no C++ compiler"), True),
        ("final", AssertionError("no C++ compiler\n" + "the traced graph, line by line\n" * 500), False),
        ("all", NotImplementedError("no C++ compiler"), False),
    ],
)
def test_a_solve_that_cannot_be_compiled_runs_on_as_without(
    monkeypatch: pytest.MonkeyPatch, save: str, error: Exception, bar: bool
) -> None:
    """Whatever the compiler raises (dynamo's failures inside a ``while_loop`` are AssertionErrors, with the graph in
    the message): one short warning that names it, then the solve as without (``bar``: with a progress bar shown)."""

    def no_compiler(device_type: str) -> Callable[..., object]:
        def fails(*_: object) -> None:
            raise error

        return fails

    _without_native(monkeypatch)
    monkeypatch.setattr(adaptive_loop, "_compiled_solve", no_compiler)
    name = type(error).__name__
    with pytest.warns(RuntimeWarning, match=rf"compile=True.*could not be compiled \({name}: no C\+\+ compiler\)") as warned:
        fallback, plain = _compiled_and_plain(_tiny_field(), _states(4), save, bar)
    assert sum("could not be compiled" in str(w.message) for w in warned) == 1  # one try, then without
    assert max(len(str(w.message)) for w in warned) < 400
    assert torch.equal(plain.x, fallback.x)
    assert (plain.stats.nfe_forward, plain.stats.sample_evaluations) == (
        fallback.stats.nfe_forward,
        fallback.stats.sample_evaluations,
    )


class _TransposedMemory(et_ode.Interaction):
    """A user's Hopfield energy written with a view of its parameter, ``g @ W.T``, which dynamo cannot trace inside a
    ``while_loop`` (its inputs would alias)."""

    def __init__(self, patterns: torch.Tensor):
        super().__init__()
        self.W = torch.nn.Parameter(patterns)

    def energy(self, g: torch.Tensor, mask: object = None) -> torch.Tensor:
        return -0.5 * torch.relu(g @ self.W.T).square().sum(dim=(-1, -2))


def test_a_user_energy_the_loop_cannot_trace_runs_uncompiled_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile=True`` on such an energy, traced by dynamo for real (its eager back end: no C++ compiler): a warning
    and the plain loop's solution, not dynamo's error. (A PyTorch that traces it compiles it: the same states.)"""
    monkeypatch.setattr(
        adaptive_loop,
        "_compiled_solve",
        lambda device_type: torch.compile(adaptive_loop._whole_solve, backend="eager", dynamic=False),
    )
    memory = _TransposedMemory(torch.randn(6, 8, dtype=F64, generator=torch.Generator().manual_seed(4)))
    field = et_ode.ETField(et_ode.EnergyModel(et_ode.LayerNormNeuron(8).double(), {"memory": memory}))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        compiled, plain = _compiled_and_plain(field, _states(2), "final")
    fell_back = [w for w in warned if "could not be compiled" in str(w.message)]
    assert len(fell_back) <= 1 and all(len(str(w.message)) < 400 for w in fell_back)
    tolerance = 0.0 if fell_back else 1e-12
    assert (compiled.x - plain.x).abs().max().item() <= tolerance
    assert compiled.stats.nfe_forward == plain.stats.nfe_forward


# -- the steady-state stop -----------------------------------------------------------------------------------------
def _mixed_batch(field: et_ode.ETField) -> torch.Tensor:
    """Three samples near rest (the ends of long solves) and three far from it: ``(6, 5, 8)``."""
    with torch.no_grad():
        easy = et_ode.solve(
            field, _states(3, seed=8), (0.0, 40.0), solver=et_ode.Adaptive(rtol=1e-9, atol=1e-9), save="final"
        ).x
    return torch.cat([easy, _states(3, seed=7)])


def test_per_sample_stop_matches_torchdiffeqs_event_times_with_fewer_evaluations() -> None:
    """``SteadyState(per_sample=True)`` on et-ode's loop: each sample leaves the batch where its RMS |dg/dt| first
    falls below tol, located inside the step (bisection on the interpolant, then Newton steps with the field); the
    stop times agree with the torchdiffeq path's event search (bisection with the field) to 2e-3 time units of
    20-95 (measured 1e-4), every final state passes the test, and it costs under half the sample-evaluations of
    that path."""
    field = _tiny_field()
    x0 = _mixed_batch(field)
    stop = et_ode.SteadyState(1e-3, per_sample=True)
    with torch.no_grad():
        theirs = et_ode.solve(field, x0, (0.0, 100.0), solver=et_ode.Adaptive(rtol=1e-6, atol=1e-8), stop=stop, save="final")
        ours = et_ode.solve(
            field,
            x0,
            (0.0, 100.0),
            stop=stop,
            save="final",
            solver=et_ode.Adaptive(rtol=1e-6, atol=1e-8, step_control="per_sample"),
        )
    assert ours.status is et_ode.Status.STEADY_STATE
    assert ours.stats.stop_times is not None and theirs.stats.stop_times is not None
    assert (ours.stats.stop_times - theirs.stats.stop_times).abs().max().item() < 2e-3
    assert bool((field.rms_dg_dt(ours.x) < 1e-3 * (1 + 1e-6)).all())
    assert float(ours.ts[-1]) == float(ours.stats.stop_times.max())
    assert ours.stats.sample_evaluations < 0.5 * theirs.stats.sample_evaluations


def test_shared_stop_ends_the_batch_at_once_and_samples_at_rest_stop_at_the_start() -> None:
    """Shared control with a joint stop ends every sample at one time where the largest measure first passes (as
    the torchdiffeq path, to 2e-3); a batch already at rest stops at t0 without a step."""
    field = _tiny_field()
    x0 = _mixed_batch(field)
    stop = et_ode.SteadyState(1e-3)
    with torch.no_grad():
        theirs = et_ode.solve(field, x0, (0.0, 100.0), solver=et_ode.Adaptive(rtol=1e-6, atol=1e-8), stop=stop, save="final")
        ours = et_ode.solve(
            field, x0, (0.0, 100.0), stop=stop, save="final", solver=et_ode.Adaptive(rtol=1e-6, atol=1e-8, loop="et_ode")
        )
        at_rest = et_ode.solve(
            field,
            x0[:3],
            (0.0, 100.0),
            stop=et_ode.SteadyState(1e-2, per_sample=True),
            save="final",
            solver=et_ode.Adaptive(step_control="per_sample"),
        )
    assert ours.stats.stop_times is not None and theirs.stats.stop_times is not None
    assert len(set(ours.stats.stop_times.tolist())) == 1
    assert abs(float(ours.stats.stop_times[0]) - float(theirs.stats.stop_times[0])) < 2e-3
    assert ours.status is et_ode.Status.STEADY_STATE
    assert at_rest.stats.stop_times is not None and bool((at_rest.stats.stop_times == 0).all())
    assert at_rest.stats.accepted_steps == 0 and torch.equal(at_rest.x, x0[:3])


def test_stop_with_the_wrong_pairing_or_saves_is_named() -> None:
    field = _tiny_field()
    x0 = _states(2)
    with pytest.raises(ValueError, match="stop=SteadyState"):
        et_ode.solve(
            field,
            x0,
            (0.0, 1.0),
            solver=et_ode.Adaptive(step_control="per_sample"),
            stop=et_ode.SteadyState(1e-3),
            save="final",
        )
    with pytest.raises(ValueError, match="save='final'"), torch.no_grad():
        et_ode.solve(field, x0, (0.0, 1.0), solver=et_ode.Adaptive(loop="et_ode"), stop=et_ode.SteadyState(1e-3))


def test_batches_of_any_shape_and_their_masks() -> None:
    """A ``(2, 3, N, D)`` batch with a ``(2, 3, N, N)`` mask steps exactly as its flattened ``(6, N, D)`` batch with
    the flattened masks; one unbatched sample ``(N, D)`` runs too; shared control reports one time for the batch."""
    field = _tiny_field()
    x0 = _states(6, tokens=4)
    generator = torch.Generator().manual_seed(2)
    masks = (torch.rand(6, 4, 4, generator=generator) > 0.4) | torch.eye(4, dtype=torch.bool)
    solver = et_ode.Adaptive(rtol=1e-7, atol=1e-9, step_control="per_sample")
    times: list[torch.Tensor] = []
    with torch.no_grad():
        flat = et_ode.solve(field.with_mask(masks), x0, (0.0, 1.0), solver=solver, save="final")
        shaped = et_ode.solve(
            field.with_mask(masks.reshape(2, 3, 4, 4)), x0.reshape(2, 3, 4, 8), (0.0, 1.0), solver=solver, save="final"
        )
        single = et_ode.solve(field, x0[0], torch.linspace(0, 1, 3), solver=solver)
        et_ode.solve(
            field, x0, (0.0, 1.0), save="final", solver=et_ode.Adaptive(loop="et_ode", progress=lambda t, n: times.append(t))
        )
    assert torch.equal(shaped.x.reshape(6, 4, 8), flat.x)
    assert single.xs is not None and single.xs.shape == (3, 4, 8)
    assert times[-1].shape == (6,) and bool((times[-1] == 1.0).all())


@pytest.mark.parametrize("step_control", ["per_sample", "shared"])
def test_direct_gradients_through_the_stop_time_match_central_differences(step_control: StepControl) -> None:
    """float64, a smooth energy, stopped at RMS |dg/dt| < 3e-2 (t ~ 3-6): the gradient of a loss of the stopped
    states in a random direction of ``x0`` and every parameter matches central differences of the whole solve to
    1e-7 (measured: 5e-9 per sample, 7e-10 shared); without the stop time's own term it is off by 36-47%."""
    model = _smooth_model(4)
    field = et_ode.ETField(model)
    x0 = _states(3, seed=9, tokens=3)
    per_sample = step_control == "per_sample"
    solver = et_ode.Adaptive(rtol=1e-10, atol=1e-10, loop="et_ode", step_control=step_control)
    stop = et_ode.SteadyState(3e-2, per_sample=per_sample)
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(x0.shape, dtype=F64, generator=generator)
    direction_x = torch.randn(x0.shape, dtype=F64, generator=generator)
    params = [p for p in model.parameters() if p.requires_grad]
    directions = [torch.randn(p.shape, dtype=F64, generator=generator) for p in params]

    def loss(x: torch.Tensor) -> torch.Tensor:
        solution = et_ode.solve(field, x, (0.0, 50.0), solver=solver, stop=stop, save="final")
        assert solution.status is et_ode.Status.STEADY_STATE
        return (solution.x * weights).sum()

    analytic, numeric = _directional_derivatives(loss, x0, direction_x, params, directions, eps=1e-6)
    assert abs(analytic - numeric) < 1e-7 * abs(numeric)


def _directional_derivatives(
    loss: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    direction_x: torch.Tensor,
    params: list[torch.Tensor],
    directions: list[torch.Tensor],
    *,
    eps: float,
) -> tuple[float, float]:
    """The derivative of ``loss`` along ``(direction_x, directions)`` in ``(x0, params)``: by autograd, and by central
    differences of step ``eps`` (the parameters shifted in place and restored)."""
    x = x0.clone().requires_grad_(True)
    grads = torch.autograd.grad(loss(x), [x, *params])
    analytic = (grads[0] * direction_x).sum() + sum((g * d).sum() for g, d in zip(grads[1:], directions, strict=True))

    def shifted(sign: float) -> float:
        with torch.no_grad():
            for p, d in zip(params, directions, strict=True):
                p.add_(sign * eps * d)
            result = loss(x0 + sign * eps * direction_x).item()
            for p, d in zip(params, directions, strict=True):
                p.sub_(sign * eps * d)
        return result

    return float(analytic), (shifted(1.0) - shifted(-1.0)) / (2 * eps)


def test_the_loop_runs_exactly_the_methods_adaptive_routes_to_it():
    """``Adaptive.OWN_METHODS`` (what the settings send to et-ode's loop) are the loop's tableaux, and a method
    outside them is refused by name."""
    assert tuple(adaptive_loop.TABLEAUX) == et_ode.Adaptive.OWN_METHODS
    with pytest.raises(ValueError, match=r"method must be one of \('dopri5', 'bosh3', 'tsit5'\)"):
        adaptive_loop.integrate(
            _tiny_field(), torch.ones(1, 3, 8, dtype=F64), torch.tensor([0.0, 1.0], dtype=F64), method="rk4"
        )
