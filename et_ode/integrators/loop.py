"""The integration loop shared by the gradient strategies of :mod:`et_ode.solving.gradients` (private to ``solve``).

A :class:`Problem` is one validated solve (field, state, time grid, solver, stop, what to save, step budget);
:func:`integrate` runs it through torchdiffeq (or :mod:`et_ode.integrators.fixed_step`'s lean loop) with a step recorder that
counts steps and raises :class:`~et_ode.integrators.solvers.SolverFailure`
on a runaway or non-finite solve, and, with a stop,
integrates grid segment by segment to the steady-state event (the grid's states are saved from that one
integration). torchdiffeq's own failures are recognised by type and place (an ``AssertionError`` or
``RuntimeError`` raised by torchdiffeq's code, not by the field it called).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torchdiffeq import odeint_event

from et_ode.dynamics.field import ETField
from et_ode.energy.checks import value_range
from et_ode.integrators.fixed_step import applies as lean_loop_applies
from et_ode.integrators.fixed_step import integrate as integrate_fixed_steps
from et_ode.integrators.solution import Progress, Save, SolveError, Status
from et_ode.integrators.solvers import BUDGET_ADVICE, Solver, SolverFailure
from et_ode.integrators.stopping import SteadyState, within_tol

GROWTH_WARNING = 1e3  # a fixed step that grows max |x| more than this many times warns (RuntimeWarning)
NON_FINITE_ADVICE = (
    "the dynamics overflowed or became too stiff for the solver there: use float64 (x0 and model), "
    "a smaller step, tighter rtol/atol, or smaller weights"
)


@dataclass
class Problem:
    """One validated solve: ``x0`` ``(*batch, N, D)``, the float64 output ``grid`` ``(T,)``, ``save`` one of
    ``"all"``, ``"steps"``, ``"final"``; ``progress`` is filled while it runs (and read for a partial solution)."""

    field: ETField
    x0: Tensor
    grid: Tensor
    solver: Solver
    stop: SteadyState | None
    save: Save
    max_steps: int
    progress: Progress = dataclasses.field(default_factory=Progress)

    def torchdiffeq_arguments(self) -> dict[str, Any]:
        """``method``, ``rtol``, ``atol``, ``options`` of the forward solve."""
        return self.solver.torchdiffeq_arguments(self.field.tau, stepping_to_event=self.stop is not None)


@dataclass
class Integrated:
    """What a gradient strategy's run returns: saved times ``ts`` ``(T,)`` and states ``xs`` (``(T, *batch, N, D)``
    or None), the final ``x`` and ``g`` ``(*batch, N, D)``, each sample's stop time ``(*batch,)`` and the status."""

    ts: Tensor
    xs: Tensor | None
    x: Tensor
    g: Tensor
    stop_times: Tensor | None
    status: Status


class Recorder(nn.Module):
    """Wraps the field for torchdiffeq, counting steps and catching runaway or non-finite solves."""

    saves_each_step = True  # fixed-step solvers accept every step

    def __init__(self, field: ETField, max_steps: int, keep_steps: bool, progress: Progress):
        super().__init__()
        self.field = field
        self.max_steps = max_steps
        self.keep_steps = keep_steps
        self.progress = progress
        self._last: tuple[Tensor, int, bool, Tensor, int] | None = None

    def forward(self, t: Tensor, x: Tensor) -> Tensor:
        return self.velocity(x, t)

    def velocity(self, x: Tensor, t: Tensor | None = None) -> Tensor:
        """``dx/dt`` at ``x``, shared by the solver and the steady-state test: an evaluation at the very tensor
        of the latest one (unchanged since, same grad mode) returns that result instead of evaluating again.
        Runge-Kutta steps end with the field at the state they accept (first-same-as-last: dopri5, bosh3) and
        the test then reads it; fixed steps start from the state the test has just evaluated."""
        last = self._last
        if (
            last is not None
            and last[0] is x
            and last[1] == x._version
            and last[2] == torch.is_grad_enabled()
            and last[4] == last[3]._version
        ):
            return last[3]
        self.progress.sample_evaluations += x.shape[:-2].numel()
        velocity = self.field(t, x)
        self._last = (x, x._version, torch.is_grad_enabled(), velocity, velocity._version)
        return velocity

    def forget(self) -> None:
        """Drop the latest evaluation: torchdiffeq's event rerouting keeps this recorder in the graph of the state it
        returns, so a recorder holding that state would tie the graph into a cycle the garbage collector cannot see."""
        self._last = None

    def callback_step(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        time, step = float(t0.detach()), float(dt.detach())
        if step > 0 and not time + step > time:  # torchdiffeq would assert "underflow in dt" next
            raise SolverFailure(
                f"the step size {step:.3g} that the error control chose does not move the time t={time:.6g}",
                time,
                f"{NON_FINITE_ADVICE}; or t lies far from 0 (the field does not depend on time: start t nearer 0)",
            )
        self.start_step(time, y0)

    def start_step(self, t0: float, y0: Tensor) -> None:
        """A step starts at time ``t0`` from ``y0``: counted, its start kept (the partial solution of a failure), its
        state checked (:meth:`check_state`); :class:`SolverFailure` past ``max_steps``."""
        progress = self.progress
        progress.steps += 1
        progress.reached(t0)
        progress.last = (t0, y0.detach() if y0.requires_grad else y0)
        if self.keep_steps and self.saves_each_step:
            progress.saved.append(progress.last)
        self.check_state(y0, progress.last[0])
        if progress.steps > self.max_steps:
            raise SolverFailure(
                f"max_steps={self.max_steps} solver steps exceeded at t={progress.last[0]:.6g}",
                progress.last[0],
                BUDGET_ADVICE,
            )

    def check_state(self, x: Tensor, t: float) -> None:
        """One pass over a step's start (or the final state) ``x`` at time ``t``: :class:`SolverFailure` if it is not
        finite; with fixed steps, the growth of ``max |x|`` since the previous one is recorded (no step-size control
        catches a blow-up there)."""
        low, high = value_range(x)
        if self.saves_each_step:
            progress = self.progress
            scale = max(-low, high)  # max |x|
            if progress.last_scale:
                progress.largest_growth = max(progress.largest_growth, scale / progress.last_scale)
            progress.last_scale = scale
        if not (math.isfinite(low) and math.isfinite(high)):
            raise SolverFailure(f"the state became non-finite (NaN or inf) by t={t:.6g}", t, NON_FINITE_ADVICE)

    def callback_step_adjoint(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        """Bounds the adjoint's backward solve by ``max_steps`` of its own; raised out of ``loss.backward()``."""
        progress = self.progress
        progress.backward_steps += 1
        states = y0 if isinstance(y0, (tuple, list)) else (y0,)
        finite = all(bool(torch.isfinite(s).all()) for s in states)
        underflow = not bool(t0 + dt > t0)  # torchdiffeq would assert next, printing the whole state
        if progress.backward_steps > self.max_steps or not finite or underflow:
            what = (
                f"more than max_steps={self.max_steps} steps"
                if progress.backward_steps > self.max_steps
                else "a non-finite adjoint state"
                if not finite
                else f"underflow in its step size {float(dt):.3g}"
            )
            raise SolveError(
                f"the adjoint's backward solve failed at t={float(t0):.6g}: {what} (the forward solve "
                f"took {progress.steps} steps); the backward dynamics are stiffer than the forward: "
                f"raise max_steps, loosen Adjoint(rtol=..., atol=...), use Adjoint(seminorm=True), or "
                f"gradient=Direct()",
                time=float(t0),
                solution=None,
            )


class AdaptiveRecorder(Recorder):
    saves_each_step = False

    def callback_accept_step(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        self.progress.accepted += 1
        self.progress.last_dt = float(dt.detach())
        self.progress.reached(float(t0.detach()) + self.progress.last_dt)
        if self.keep_steps:
            self.progress.saved.append((float(t0.detach()), y0.detach()))

    def callback_reject_step(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        self.progress.rejected += 1


def _raised_by_torchdiffeq(error: BaseException) -> bool:
    """Whether torchdiffeq's own code (its innermost frame) raised ``error``, not the field it called."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and str(frame.tb_frame.f_globals.get("__name__", "")).startswith("torchdiffeq")


def integrate(
    problem: Problem, interface: Callable[..., Any], arguments: dict[str, Any], *, lean: bool = False
) -> Integrated:
    """Run ``problem`` through the torchdiffeq ``interface`` (``odeint`` or ``odeint_adjoint``) with ``arguments``
    (``method``, ``rtol``, ``atol``, ``options`` and the adjoint's), or through the lean fixed-step loop when ``lean``
    and it applies. Raises :class:`SolverFailure` where the integration cannot go on."""
    field, x0, grid, progress = problem.field, problem.x0, problem.grid, problem.progress
    recorder = (AdaptiveRecorder if problem.solver.adaptive else Recorder)(
        field, problem.max_steps, keep_steps=problem.save == "steps", progress=progress
    )
    method, options = arguments["method"], arguments["options"]
    stop_times, status = None, Status.REACHED_END
    saved: list[tuple[float, Tensor]] = []
    try:
        own_loop = getattr(problem.solver, "own_loop", None)
        if own_loop is not None and own_loop(problem.stop, problem.save, arguments.get("adjoint_method")):
            from et_ode.integrators.adaptive_loop import solve_adaptive

            x_final, xs, ts, stop_times, status = solve_adaptive(
                problem.solver,  # type: ignore[arg-type]
                field,
                x0,
                grid,
                arguments,
                problem.max_steps,
                problem.save,
                progress,
                problem.stop,
            )
        elif problem.stop is None and lean and lean_loop_applies(method, options):
            xs = integrate_fixed_steps(recorder, x0, grid, method, options.get("step_size"), save_all=problem.save == "all")
            ts, x_final = grid, xs[-1]
        elif problem.stop is None:
            xs = interface(recorder, x0, grid, **arguments)
            ts, x_final = grid, xs[-1]
        else:
            ends = grid[1:] if problem.save == "all" else grid[-1:]
            x_final, stop_times, status, saved = _to_steady_state(
                recorder, x0, grid[0], ends, problem.stop, interface, arguments
            )
            ts = torch.tensor(
                [float(grid[0]), *(t for t, _ in saved), float(stop_times.max())], dtype=grid.dtype, device=grid.device
            )
            xs = None
    except (AssertionError, RuntimeError) as error:
        if not _raised_by_torchdiffeq(error):
            raise
        # torchdiffeq asserts both a step underflow and its own step cap (``options=dict(max_num_steps=...)``)
        capped = isinstance(error, AssertionError) and "max_num_steps" in str(error)
        advice = NON_FINITE_ADVICE if isinstance(error, AssertionError) and not capped else BUDGET_ADVICE
        last_time = progress.last[0] if progress.last else float(grid[0])
        raise SolverFailure(f"torchdiffeq stopped after t={last_time:.6g}: {error}", last_time, advice) from error
    recorder.check_state(x_final, float(ts[-1]))  # finite, and the last fixed step's growth
    if not problem.solver.adaptive and progress.largest_growth > GROWTH_WARNING:
        warnings.warn(
            f"solve ({problem.solver.name}): one fixed step grew the state {progress.largest_growth:.3g}-fold "
            f"(largest |x|): the step is far too large for this field (stiff, or large weights), so the "
            f"result is not an accurate solution and the state heads for overflow. Use a smaller step, more "
            f"steps, or an adaptive method",
            RuntimeWarning,
            stacklevel=4,
        )
    if not problem.solver.adaptive and problem.stop is not None:  # torchdiffeq's fixed-step event loop has no
        progress.steps = round((float(ts[-1]) - float(grid[0])) / options["step_size"])  # step callback
    with torch.no_grad():
        if problem.stop is not None and problem.save == "all":  # the grid's states before the stop, and the stop
            xs = torch.stack([x0.detach(), *(x for _, x in saved), x_final.detach()])
        elif problem.save == "steps":
            ts, xs = _steps_saved(progress, ts, x0, x_final)
        elif problem.save == "final":
            ts, xs = ts[-1:], None
    return Integrated(ts=ts, xs=xs, x=x_final, g=field.activation(x_final), stop_times=stop_times, status=status)


class _StopTimeParameterTerm(torch.autograd.Function):
    """Identity on the state at a steady-state stop; its backward adds the stop test's direct dependence on the
    parameters, which torchdiffeq's ``odeint_event`` drops (it carries the stop time's gradient through the state).

    The stop time ``t*`` solves ``c(x(t*), theta) = 0``, so ``dt*/dtheta|direct = -(dc/dtheta) / (dc/dt)`` with
    ``dc/dt = dc/dx . f + dc/dt|explicit``, and the loss sees ``t*`` through ``x(t*)``: ``dL/dt* = dL/dx . f``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        t_event: Tensor,
        event_fn: Callable[[Tensor, Tensor], Tensor],
        velocity: Callable[[Tensor], Tensor],
        *params: Tensor,
    ) -> Tensor:
        ctx.event_fn, ctx.velocity = event_fn, velocity
        ctx.save_for_backward(x.detach(), t_event.detach(), *params)
        return x.detach().clone()

    @staticmethod
    def backward(ctx: Any, v: Tensor) -> tuple[Tensor | None, ...]:
        x, t_event, *params = ctx.saved_tensors
        with torch.enable_grad():
            state = x.detach().clone().requires_grad_(True)
            time = t_event.detach().clone().requires_grad_(True)
            value = ctx.event_fn(time, state)
            wrt = [state, time, *[p for p in params if p.requires_grad]]
            grads = torch.autograd.grad(value, wrt, allow_unused=True)
        with torch.no_grad():
            f = ctx.velocity(x)
        dc_dx = torch.zeros_like(x) if grads[0] is None else grads[0]
        dc_dt = (dc_dx * f).sum() + (0.0 if grads[1] is None else grads[1])
        dl_dt = (v * f).sum()
        factor = torch.where(dc_dt != 0, -dl_dt / dc_dt, torch.zeros_like(dl_dt))
        direct = iter(grads[2:])
        param_grads = []
        for p in params:
            grad = next(direct) if p.requires_grad else None
            param_grads.append(None if grad is None else factor * grad)
        return (v, None, None, None, *param_grads)


def _event_function(
    stop: SteadyState, field: ETField, velocity: Callable[[Tensor], Tensor], t_end: Tensor
) -> Callable[[Tensor, Tensor], Tensor]:
    """The stop's event ``c(t, y)``: ``log(measure / tol)`` of the smallest (per sample) or largest (jointly) measure
    of ``field``, capped by the time left to ``t_end``; ``velocity(y)`` gives ``dx/dt`` (a recorder's, sharing the
    solver's evaluations, or the field's own)."""

    def event_fn(t: Tensor, y: Tensor) -> Tensor:
        values = stop.rms(field, y, velocity(y))
        crossing = torch.log((values.min() if stop.per_sample else values.max()) / stop.tol)
        return torch.minimum(crossing, (t_end - t).to(crossing.dtype))

    return event_fn


def _to_steady_state(
    recorder: Recorder, x0: Tensor, t0: Tensor, ends: Tensor, stop: SteadyState, interface: Any, arguments: dict[str, Any]
) -> tuple[Tensor, Tensor, Status, list[tuple[float, Tensor]]]:
    """Integrate from ``t0`` until every sample's measure is below ``stop.tol``, or to ``ends[-1]``.

    Jointly (``per_sample=False``): one event, the largest measure of the batch crossing ``tol``, integrated
    segment by segment to each time of ``ends`` ``(S,)`` (the state at every end reached before the stop is kept).
    Per sample (``ends`` is the last time alone): the smallest measure among the samples still running crosses
    ``tol``; those that converged leave the batch and the rest continue from there, each segment a solve of its own
    on the remaining samples. Returns the final states, each sample's stopping time ``(*batch,)``, the status and
    the kept ``(time, state)`` pairs (detached).
    """
    field, tol, per_sample = recorder.field, stop.tol, stop.per_sample
    t_last = ends[-1]
    batch_shape = x0.shape[:-2]
    stop_times = torch.full(batch_shape, float(t_last), dtype=ends.dtype)
    finals: list[Tensor | None] = [None] * (x0.shape[0] if per_sample else 1)
    active = torch.arange(len(finals))
    saved: list[tuple[float, Tensor]] = []
    x, t_start, end_index, restarts = x0, t0, 0, 0
    while len(active):
        t_end = ends[end_index]
        segment_field = field.select(active) if per_sample else field
        segment = type(recorder)(segment_field, recorder.max_steps, recorder.keep_steps, recorder.progress)
        with torch.no_grad():
            converged = stop.rms(segment_field, x, segment.velocity(x)) < tol
        if not per_sample:
            converged = converged.all().reshape(1)
        ran_out = torch.zeros_like(converged)  # samples that stop at the end of the span without converging
        if not bool(converged.any()):  # (samples converged at a segment's start stop before integrating)
            event_fn = _event_function(stop, segment_field, segment.velocity, t_end)

            if float(t_start) + 1.0 == float(t_start):  # torchdiffeq's event search sets out for t_start + 1
                raise SolverFailure(
                    f"torchdiffeq's event search cannot set out from t={float(t_start):.6g}, where t + 1 does not "
                    f"move the time in float64",
                    float(t_start),
                    "start t nearer 0 (the field does not depend on time), or use et-ode's loop (Adaptive(loop='et_ode'))",
                )
            segment_arguments = arguments
            if recorder.progress.last_dt is not None:  # continue with the step size the last segment reached
                options = dict(arguments["options"], first_step=recorder.progress.last_dt)
                segment_arguments = dict(arguments, options=options)
            t_event, xs = odeint_event(
                segment, x, t_start, event_fn=event_fn, odeint_interface=interface, **segment_arguments
            )
            t_start, x = t_event.detach(), xs[-1]
            params = tuple(p for p in field.parameters() if p.requires_grad)
            if torch.is_grad_enabled() and params:  # the stop test's own dependence on the parameters
                # (closures over the field alone: one over the recorder, which holds the latest state, would tie
                # the graph to itself in a cycle that outlives the solve)
                velocity = functools.partial(segment_field, None)
                x = _StopTimeParameterTerm.apply(
                    x, t_start, _event_function(stop, segment_field, velocity, t_end), velocity, *params
                )
            with torch.no_grad():
                converged = within_tol(stop.rms(segment_field, x, segment.velocity(x)), tol)
            segment.forget()
            if not per_sample:
                converged = converged.all().reshape(1)
            # torchdiffeq's event search bisects to atol: a segment's end is found within atol / 2 of t_end
            at_end = float(t_end) - float(t_start) <= float(arguments["atol"]) + 1e-12 * abs(float(t_end))
            if at_end and not bool(converged.any()) and end_index + 1 < len(ends):
                saved.append((float(t_end), x.detach()))  # a saved time before the stop: keep it, go on to the next
                end_index += 1
                continue
            if not at_end and not bool(converged.any()):  # the test crossed at a step's end, not on its interpolant
                restarts += 1  # (the measure at the rounding of its dtype): integrate on from the search's end
                if restarts > recorder.max_steps:
                    raise SolverFailure(
                        f"the steady-state test crossed {stop.description} at step ends but not between them "
                        f"{restarts} times, by t={float(t_start):.6g}",
                        float(t_start),
                        "loosen SteadyState.tol, or use float64 (x0 and model)",
                    )
                continue
            if at_end:
                ran_out = ~converged
                converged = torch.ones_like(converged)  # the end of the time span: everyone stops
        for position in torch.nonzero(converged).flatten().tolist():
            index = int(active[position])
            finals[index] = x[position] if per_sample else x
            # a sample that did not converge carries the span's end, never the event search's approximation of it
            stop_value = float(t_last) if bool(ran_out[position]) else min(float(t_start), float(t_last))
            if per_sample:
                stop_times[index] = stop_value
            else:
                stop_times.fill_(stop_value)
        keep = ~converged
        active, x = active[keep], (x[keep] if per_sample else x)
    stopped = [x for x in finals if x is not None]  # every sample has stopped
    x_final = torch.stack(stopped) if per_sample else stopped[0]
    with torch.no_grad():
        reached = bool(within_tol(stop.rms(field, x_final, recorder.velocity(x_final)), tol).all())
    recorder.forget()
    status = Status.STEADY_STATE if reached and float(stop_times.max()) < float(t_last) else Status.REACHED_END
    return x_final, stop_times, status, saved


def _steps_saved(progress: Progress, ts: Tensor, x0: Tensor, x_final: Tensor) -> tuple[Tensor, Tensor]:
    """The start of every accepted step, then the final state."""
    times = [t for t, _ in progress.saved] + [float(ts[-1])]
    states = [s for _, s in progress.saved] + [x_final.detach()]
    if not progress.saved or times[0] > float(ts[0]):
        times.insert(0, float(ts[0]))
        states.insert(0, x0.detach())
    return torch.tensor(times, dtype=ts.dtype, device=ts.device), torch.stack(states)
