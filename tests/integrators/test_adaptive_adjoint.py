"""The adjoint on et-ode's adaptive loop (``gradient="adjoint"`` with ``Adaptive(loop="et_ode")``): the backward solve
per sample or shared, through saved times and from each sample's steady-state stop, against central differences of
the whole solve in float64; per-sample masks through compaction; the backward's own method and step budget."""

from __future__ import annotations

import pytest
import torch

import et_ode
from et_ode.integrators import adaptive_loop
from tests.integrators.test_adaptive_loop import StepControl, _directional_derivatives, _smooth_model, _states

F64 = torch.float64


def _directions(model: et_ode.EnergyTransformer, x0: torch.Tensor, extra: int = 0):  # type: ignore[no-untyped-def]
    """Random weights of the loss ``(extra, *x0.shape)`` or ``x0.shape``, a direction in ``x0`` and one per parameter."""
    generator = torch.Generator().manual_seed(1)
    shape = (extra, *x0.shape) if extra else x0.shape
    weights = torch.randn(shape, dtype=F64, generator=generator)
    direction_x = torch.randn(x0.shape, dtype=F64, generator=generator)
    params = [p for p in model.parameters() if p.requires_grad]
    directions = [torch.randn(p.shape, dtype=F64, generator=generator) for p in params]
    return weights, direction_x, params, directions


@pytest.mark.parametrize("step_control", ["per_sample", pytest.param("shared", marks=pytest.mark.slow)])
def test_adjoint_through_saved_times_matches_central_differences(step_control: StepControl) -> None:
    """float64, a smooth energy, states saved at t = 0, 0.5, 1: the adjoint's gradient of a loss of every saved state
    in a random direction of ``x0`` and every parameter matches central differences of the whole solve to 1e-7
    (measured: 7e-9 per sample, 4e-9 shared; the backward solve's tolerance bounds it), and the backward's
    evaluations are counted."""
    model = _smooth_model(4)
    field = et_ode.ETField(model)
    x0 = _states(2, seed=9, tokens=3)
    grid = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
    solver = et_ode.Adaptive(rtol=1e-10, atol=1e-10, step_control=step_control, loop="et_ode")
    weights, direction_x, params, directions = _directions(model, x0, extra=3)
    solutions: list[et_ode.Solution] = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        solution = et_ode.solve(field, x, grid, solver=solver, gradient="adjoint")
        solutions.append(solution)
        assert solution.xs is not None
        return (solution.xs * weights).sum()

    analytic, numeric = _directional_derivatives(loss, x0, direction_x, params, directions, eps=1e-5)
    assert abs(analytic - numeric) < 1e-7 * abs(numeric)
    assert solutions[0].stats.nfe_backward > solutions[0].stats.nfe_forward


@pytest.mark.parametrize("step_control", ["per_sample", pytest.param("shared", marks=pytest.mark.slow)])
def test_adjoint_from_the_stop_matches_central_differences(step_control: StepControl) -> None:
    """float64, stopped at RMS |dg/dt| < 3e-2 (each sample at its own time per sample, t ~ 3-6): the backward solve
    starts at each sample's stop and the stop time's own term is added; the gradient in a random direction of
    ``x0`` and every parameter matches central differences of the whole solve to 1e-7 (measured: 5e-9 per sample,
    1.5e-9 shared)."""
    model = _smooth_model(4)
    field = et_ode.ETField(model)
    x0 = _states(3, seed=9, tokens=3)
    per_sample = step_control == "per_sample"
    solver = et_ode.Adaptive(rtol=1e-10, atol=1e-10, step_control=step_control, loop="et_ode")
    stop = et_ode.SteadyState(3e-2, per_sample=per_sample)
    weights, direction_x, params, directions = _directions(model, x0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        solution = et_ode.solve(field, x, (0.0, 50.0), solver=solver, gradient="adjoint", stop=stop, save="final")
        assert solution.status is et_ode.Status.STEADY_STATE and solution.stats.stop_times is not None
        assert len(set(solution.stats.stop_times.tolist())) == (3 if per_sample else 1)
        return (solution.x * weights).sum()

    analytic, numeric = _directional_derivatives(loss, x0, direction_x, params, directions, eps=1e-6)
    assert abs(analytic - numeric) < 1e-7 * abs(numeric)


def test_adjoint_per_sample_equals_each_sample_alone_with_its_mask() -> None:
    """A mask per sample: the batch's adjoint gradient of a sum of per-sample losses is, in ``x0``, each sample's
    gradient alone and, in the parameters, the sum of theirs (to 1e-9 relative): the backward solve and the
    parameter quadrature bind each sample's own mask as samples leave the batch."""
    model = _smooth_model(2)
    field = et_ode.ETField(model)
    x0 = _states(3, tokens=4)
    generator = torch.Generator().manual_seed(0)
    masks = (torch.rand(3, 4, 4, generator=generator) > 0.4) | torch.eye(4, dtype=torch.bool)
    solver = et_ode.Adaptive(rtol=1e-8, atol=1e-9, step_control="per_sample")
    params = [p for p in model.parameters() if p.requires_grad]

    def gradients(rows: slice) -> list[torch.Tensor]:
        x = x0[rows].clone().requires_grad_(True)
        solution = et_ode.solve(field.with_mask(masks[rows]), x, (0.0, 1.5), solver=solver, gradient="adjoint")
        return list(torch.autograd.grad(solution.x.square().sum(), [x, *params]))

    batch = gradients(slice(None))
    alone = [gradients(slice(i, i + 1)) for i in range(3)]
    x_alone = torch.cat([grads[0] for grads in alone])
    assert (batch[0] - x_alone).abs().max() < 1e-9 * x_alone.abs().max()
    for i, grad in enumerate(batch[1:], start=1):
        summed = sum(grads[i] for grads in alone)
        assert (grad - summed).abs().max() < 1e-9 * max(summed.abs().max().item(), 1e-12)  # type: ignore[union-attr]


def test_the_backward_solve_has_its_own_budget_and_method() -> None:
    """The backward solve gets ``max_steps`` steps of its own: at tolerances far tighter than the forward's it runs
    out and ``loss.backward()`` raises :class:`et_ode.SolveError` naming the adjoint; a backward method this loop
    does not run is a ValueError naming ``Adjoint.method``."""
    field = et_ode.ETField(_smooth_model(1))
    x0 = _states(2).requires_grad_(True)
    solver = et_ode.Adaptive(rtol=1e-4, atol=1e-6, loop="et_ode")
    steps = et_ode.solve(field, x0.detach(), (0.0, 1.0), solver=solver, save="final").stats.accepted_steps
    tight = et_ode.Adjoint(rtol=1e-12, atol=1e-12)
    solution = et_ode.solve(field, x0, (0.0, 1.0), solver=solver, gradient=tight, save="final", max_steps=steps + 2)
    with pytest.raises(et_ode.SolveError, match=r"adjoint's backward solve failed at t=0\.\d+: more than max_steps="):
        solution.x.sum().backward()
    with pytest.raises(ValueError, match="Adjoint.method"):
        et_ode.solve(field, x0, (0.0, 1.0), solver=solver, gradient=et_ode.Adjoint(method="rk4"), save="final")


@pytest.mark.parametrize("case", ["mask_per_sample", "rejected_steps", "per_sample_stage_by_stage"])
def test_adjoint_parameter_quadrature_matches_central_differences(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameter quadrature's paths with a mask per sample ``(B, N, N)``: one step size for the batch, where it
    weighs the pullbacks that the backward's evaluations recorded, once as it is and once with a first step far too
    long, so that the backward solve rejects steps (their pullbacks dropped, the solve's first evaluation kept for
    the first accepted step); and per sample, evaluating the field a stage at a time (as above ``STACK_LIMIT``).
    The gradient in a random direction of ``x0`` and every parameter matches central differences of the whole solve
    to 1e-7."""
    model = _smooth_model(2)
    x0 = _states(3, seed=4, tokens=4)
    generator = torch.Generator().manual_seed(3)
    masks = (torch.rand(3, 4, 4, generator=generator) > 0.5) | torch.eye(4, dtype=torch.bool)
    field = et_ode.ETField(model).with_mask(masks)
    options = dict(first_step=1.0) if case == "rejected_steps" else None
    step_control: StepControl = "per_sample" if case == "per_sample_stage_by_stage" else "shared"
    if case == "per_sample_stage_by_stage":
        monkeypatch.setattr(adaptive_loop, "STACK_LIMIT", 0)
    solver = et_ode.Adaptive(rtol=1e-10, atol=1e-10, step_control=step_control, options=options)
    weights, direction_x, params, directions = _directions(model, x0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        solution = et_ode.solve(field, x, (0.0, 2.0), solver=solver, gradient="adjoint", save="final")
        return (solution.x * weights).sum()

    analytic, numeric = _directional_derivatives(loss, x0, direction_x, params, directions, eps=1e-6)
    assert abs(analytic - numeric) < 1e-7 * abs(numeric)


@pytest.mark.parametrize("step_control", ["shared", "per_sample"])
def test_adjoint_with_frozen_parameters_gives_the_gradient_of_the_start(step_control: StepControl) -> None:
    """No parameter asks for a gradient (all frozen), only ``x0``: the backward solve runs without a parameter
    quadrature and the gradient in a random direction of ``x0`` matches central differences to 1e-7."""
    model = _smooth_model(2)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    field = et_ode.ETField(model)
    x0 = _states(3, seed=6, tokens=3)
    solver = et_ode.Adaptive(rtol=1e-10, atol=1e-10, step_control=step_control)
    weights, direction_x, _, _ = _directions(model, x0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        solution = et_ode.solve(field, x, (0.0, 1.0), solver=solver, gradient="adjoint", save="final")
        return (solution.x * weights).sum()

    analytic, numeric = _directional_derivatives(loss, x0, direction_x, [], [], eps=1e-6)
    assert abs(analytic - numeric) < 1e-7 * abs(numeric)
