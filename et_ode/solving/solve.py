"""One solve function for the ET dynamics, returning a :class:`~et_ode.integrators.solution.Solution` with its statistics.

``solve`` is a dispatcher: it validates the field and the state once, lets each settings object check its own rules
(:mod:`et_ode.integrators.solvers`, :mod:`et_ode.solving.gradients`, :mod:`et_ode.integrators.stopping`),
builds the time grid, hands the problem to
the gradient strategy (which runs the integration) and assembles the solution.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from et_ode.backend import runtime
from et_ode.backend.memory import memory_named
from et_ode.backend.validation import check_positive
from et_ode.dynamics.field import ETField
from et_ode.energy.checks import check_mask, check_tokens
from et_ode.integrators.loop import Problem
from et_ode.integrators.solution import SAVES, Progress, Save, Solution, SolveError, SolveStats, Status
from et_ode.integrators.solvers import Method, Solver, SolverFailure, as_solver
from et_ode.integrators.stopping import SteadyState
from et_ode.solving.gradients import Gradient, GradientName, as_gradient

MEMORY_ADVICE = "solve fewer samples at a time, save='final' instead of every state, or use another device"


def solve(
    field: ETField,
    x0: Tensor,
    t: Tensor | Sequence[float] | None = None,
    *,
    solver: Solver | Method = "dopri5",
    gradient: Gradient | GradientName = "direct",
    stop: SteadyState | None = None,
    save: Save = "all",
    max_steps: int = 10_000,
    progress: bool | None = None,
) -> Solution:
    """Integrate ``tau dx/dt = -dE/dg`` from ``x0`` of shape ``(*batch, N, D)``.

    Args:
        field: the vector field, with its mask (``field.with_mask(mask)`` binds another).
        x0: initial state ``(*batch, N, D)``, of the model's dtype and device.
        t: 1-D tensor of output times, or ``(t0, t1)``; ``None`` (or ``(t0,)``) with :class:`~et_ode.EulerET`,
            which builds its own grid.
        solver: :class:`~et_ode.Adaptive` (default ``"dopri5"``, i.e. ``Adaptive("dopri5", rtol=1e-5, atol=1e-6)``),
            :class:`~et_ode.Fixed` or :class:`~et_ode.EulerET`, or a method's name (``"dopri5"``, ``"rk4"`` on the
            grid ``t``, ``"et"``).
        gradient: :class:`~et_ode.Direct` (default ``"direct"``), :class:`~et_ode.Adjoint` or
            :class:`~et_ode.Implicit` (needs a ``stop``; gradients through ``Solution.g`` only), or the name of one.
        stop: :class:`~et_ode.SteadyState`, or None to integrate to the end of ``t``.
        save: ``"all"`` (the states at the times ``t``; with a stop, those before the stop and the stop itself, all
            from the one integration), ``"steps"`` (every accepted step of an adaptive method, every step of a fixed
            one) or ``"final"``.
        progress: show a progress bar (tqdm, on standard error) over the time span while the solve runs; None
            (the default): off, unless :func:`et_ode.backend.runtime.show_solve_progress` turned it on (the command line
            does), and then shown once the solve has run a few seconds.
        max_steps: raise :class:`SolveError` after this many solver steps (fixed steps are counted before any work);
            with :class:`~et_ode.Adjoint` the backward solve has a budget of its own of as many steps (its SolveError
            comes out of ``loss.backward()``).

    Returns:
        A :class:`~et_ode.Solution`: the saved times and states, the final state ``x`` and ``g = LayerNorm(x)``,
        how the solve ended and its :class:`~et_ode.SolveStats`.

    Raises:
        TypeError: ``field`` is not an ETField; ``stop`` is not a SteadyState; ``x0`` or the mask of the wrong type or
            dtype (``x0`` must have the model's dtype).
        ValueError: a bad argument, named: unknown solver or gradient, bad ``save``, ``max_steps`` or ``t``; ``x0`` of
            the wrong shape, with N = 0 or an empty batch, non-finite, too large for its dtype (the LayerNorm's
            variance overflows: use float64), half precision with an adaptive method, or on another device; a
            settings object's rule (``Implicit`` without a stop, a stop with ``Fixed`` without a step size,
            ``SteadyState(per_sample=True)`` without ``save="final"`` and a ``(batch, N, D)`` state); what ``x0``'s
            dtype cannot hold: times ``t`` beyond its range (or, with a stop and fixed steps, where a step does not
            move the time), a ``SteadyState.tol`` below what the measure resolves in it.
        SolveError: too many steps, step-size underflow, or a non-finite state (the message says where and what to
            try); ``error.solution`` holds the partial solution (``status`` FAILED).
        et_ode.backend.memory.OutOfMemoryError: the solve ran out of memory (naming ``x0``'s shape and the bytes asked
            for).
    """
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    solver, gradient = as_solver(solver), as_gradient(gradient)
    if stop is not None and not isinstance(stop, SteadyState):
        raise TypeError(f"stop must be an et_ode.SteadyState or None, got {type(stop).__name__}")
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    check_positive("max_steps", max_steps, integer=True)
    layer_norm = field.model.neuron.geometry == "spheres"
    check_tokens("x0", x0, field.model.dim, like=field.model.reference_tensor, normalisable=layer_norm)
    if x0.shape[:-2].numel() == 0:
        raise ValueError(f"x0 has an empty batch: shape {tuple(x0.shape)} (*batch, N, D); give at least one sample")
    check_mask(field.mask, x0)
    solver.check_state(x0)
    solver.check_stop(stop)
    gradient.check(stop)
    if stop is not None:
        stop.check(x0, save)

    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool or None, got {progress!r}")
    delay = 0.0 if progress else runtime.SLOW_SOLVE_SECONDS
    progress = runtime.solve_progress_default() if progress is None else progress
    record = Progress()
    nfe_before = field.evaluations.made()  # this thread's count: solves in other threads are not this one's
    started = time.perf_counter()
    try:
        grid = solver.time_grid(t, field.tau, x0.device, max_steps)
        _check_times(grid, x0.dtype, solver, stop, field.tau)
        with (
            _progress_bar(progress, grid, solver.name, delay) as bar,
            memory_named(f"solve: x0 of shape {tuple(x0.shape)} ({x0.dtype}, {x0.device})", MEMORY_ADVICE),
        ):
            record.bar, record.t0 = bar, float(grid[0])
            result = gradient.run(Problem(field, x0, grid, solver, stop, save, max_steps, record))
    except SolverFailure as failure:
        partial = _partial_solution(field, record, x0, nfe_before, time.perf_counter() - started)
        raise SolveError(
            f"solve failed ({solver.name}): {failure}; {failure.advice}", time=failure.time, solution=partial
        ) from failure
    stats = SolveStats(
        nfe_forward=field.evaluations.made() - nfe_before,
        accepted_steps=record.accepted if solver.adaptive else record.steps,
        rejected_steps=record.rejected,
        wall_time=time.perf_counter() - started,
        t_final=float(result.ts[-1]),
        status=result.status,
        field=field,
        nfe_at_return=field.nfe,
        sample_evaluations=record.sample_evaluations,
        stop_times=result.stop_times,
        steady_state_measure=None if stop is None else stop.measure,
    )
    return Solution(ts=result.ts, xs=result.xs, x=result.x, g=result.g, stats=stats, field=field)


def _check_times(grid: Tensor, dtype: torch.dtype, solver: Solver, stop: SteadyState | None, tau: float) -> None:
    """The times of a solve, representable in the state's ``dtype`` (ValueError naming ``t``): the solvers hand the
    field its times in that dtype, and a fixed-step stop (torchdiffeq's event loop) counts time in it, so each of its
    steps must move the time at the end of the span."""
    largest, finfo = float(grid.abs().max()), torch.finfo(dtype)
    if largest > finfo.max:
        raise ValueError(
            f"t reaches {largest:.3g}, beyond the largest {dtype} number ({finfo.max:.3g}), x0's dtype, in which the "
            f"solver hands the field its times: shorten t, or use float64 (x0 and model)"
        )
    step = None if stop is None or solver.adaptive else solver.torchdiffeq_arguments(tau, True)["options"].get("step_size")
    if step is not None:
        end = torch.tensor(largest, dtype=dtype)
        if not bool(end + torch.tensor(step, dtype=dtype) > end):
            raise ValueError(
                f"t reaches {largest:.6g}, where a step of {step:g} does not move the time in x0's dtype {dtype} (a stop "
                f"with fixed steps counts time in it): start t nearer 0 (the field does not depend on time), take "
                f"larger steps, or use float64 (x0 and model)"
            )


@contextlib.contextmanager
def _progress_bar(show: bool, grid: Tensor, name: str, delay: float) -> Iterator[Any]:
    """A tqdm bar over the time span of ``grid`` (time as its unit), drawn after ``delay`` seconds, or None when not
    ``show``n."""
    if not show:
        yield None
        return
    from tqdm.auto import tqdm

    with tqdm(
        total=abs(float(grid[-1] - grid[0])),
        desc=f"solve ({name})",
        unit="t",
        leave=False,
        delay=delay,
        bar_format="{desc}: t {n:.4g}/{total:.4g} |{bar}| {elapsed}<{remaining}",
    ) as bar:
        yield bar


def _partial_solution(field: ETField, progress: Progress, x0: Tensor, nfe_before: int, wall_time: float) -> Solution:
    """What a failed solve computed: its last recorded state (``x0`` before the first step), status FAILED."""
    t_last, x_last = progress.last if progress.last is not None else (0.0, x0.detach())
    ts = torch.tensor([t_last], dtype=torch.float64)
    with torch.no_grad():
        g = field.model.neuron(x_last)
    stats = SolveStats(
        nfe_forward=field.evaluations.made() - nfe_before,
        accepted_steps=progress.accepted or progress.steps,
        rejected_steps=progress.rejected,
        wall_time=wall_time,
        t_final=t_last,
        status=Status.FAILED,
        field=field,
        nfe_at_return=field.nfe,
        sample_evaluations=progress.sample_evaluations,
    )
    return Solution(ts=ts, xs=x_last[None], x=x_last, g=g, stats=stats, field=field)
