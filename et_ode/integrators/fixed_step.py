"""The lean fixed-step loop behind :func:`et_ode.solve`: the paper's scheme and the euler, midpoint and rk4 methods.

torchdiffeq's fixed-grid solvers (0.2.5) wrap the field in two modules of theirs and our recorder, take the absolute
value of the whole state at every evaluation (only to learn the time's dtype) and copy every step into a solution
tensor. Here a step is the field's evaluations, the update and the recorder's ``start_step`` (its checks of growth
and finiteness share one ``aminmax`` pass): the same floating-point operations in the same order as torchdiffeq's
steps (the increment ``dt * f`` rounded, then added to the state; the times in float64, handed to the field in the
state's dtype), so states, statistics, warnings and failures agree with torchdiffeq's path bit for bit. Without
gradients the state is added into the step's increment, a new tensor of the step's own (``y + dy``'s bits: addition
commutes), so no state is ever overwritten; with gradients the update runs out of place, so that autograd records
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from et_ode.dynamics.field import ETField

LEAN_METHODS = ("euler", "midpoint", "rk4")  # the fixed-step methods this loop runs

# the stage times of a step, as fractions of ``dt`` in torchdiffeq's expressions (``t0 + dt * c``)
_ONE_THIRD, _TWO_THIRDS = 1 / 3, 2 / 3
_STAGES = {"euler": 1, "midpoint": 2, "rk4": 4}

Field = Callable[[Tensor | None, Tensor], Tensor]


class StepRecorder(Protocol):
    """What the loop needs of ``solve``'s recorder: the field, its progress and its per-step hook."""

    field: Any  # an ETField: called as field(t, x), with an ``evaluations`` counter
    keep_steps: bool
    progress: Any  # its sample_evaluations count the evaluations; start_step fills the rest

    def start_step(self, t0: float, y0: Tensor) -> None: ...


def applies(method: str, options: dict[str, Any]) -> bool:
    """Whether the lean loop integrates ``method`` with these torchdiffeq ``options`` (only ``step_size``; no
    ``perturb``, ``interp`` or ``grid_constructor``, which keep torchdiffeq's own loop)."""
    return method in LEAN_METHODS and set(options) <= {"step_size"}


def step_grid(grid: Tensor, step_size: float | None) -> Tensor:
    """The times the solver steps on: ``grid`` itself, or steps of ``step_size`` from ``grid[0]`` ending exactly at
    ``grid[-1]`` (torchdiffeq's construction, so the same float64 times): ``(steps + 1,)``."""
    if step_size is None:
        return grid
    count = torch.ceil((grid[-1] - grid[0]) / step_size + 1).item()
    times = torch.arange(0, count, dtype=grid.dtype, device=grid.device) * step_size + grid[0]
    times[-1] = grid[-1]
    return times


def _stage_times(times: Tensor, method: str, dtype: torch.dtype) -> Tensor:
    """The time of every evaluation, ``(steps, stages)``: computed in float64 as torchdiffeq does, then cast to the
    state's dtype as its wrapper does before calling the field."""
    t0, t1 = times[:-1], times[1:]
    dt = t1 - t0
    if method == "euler":
        stages = [t0]
    elif method == "midpoint":
        stages = [t0, t0 + 0.5 * dt]
    else:
        stages = [t0, t0 + dt * _ONE_THIRD, t0 + dt * _TWO_THIRDS, t1]
    return torch.stack(stages, dim=1).to(dtype)


def _increment(
    method: str, field: Field, t: tuple[Tensor | None, ...], dt: Tensor, y: Tensor, scale_in_place: bool = False
) -> Tensor:
    """``y1 - y0`` of one step from ``y``, with torchdiffeq's operations in torchdiffeq's order: ``t`` the stage times
    (0-d tensors, one per stage) in the state's dtype, or None for an :class:`ETField`, which never reads them;
    ``dt`` a float64 0-d tensor (a Python float would round differently in bfloat16). A new tensor.
    ``scale_in_place`` (no gradients, and a field whose every output is a new tensor): an Euler step scales the
    field's output in place, the same bits as ``dt * f`` without allocating a state-sized tensor."""
    if method == "euler":
        velocity = field(t[0], y)
        return velocity.mul_(dt) if scale_in_place else dt * velocity
    if method == "midpoint":
        half_dt = 0.5 * dt
        y_mid = y + field(t[0], y) * half_dt
        return dt * field(t[1], y_mid)
    k1 = field(t[0], y)
    k2 = field(t[1], y + dt * k1 * _ONE_THIRD)
    k3 = field(t[2], y + dt * (k2 - k1 * _ONE_THIRD))
    k4 = field(t[3], y + dt * (k1 - k2 + k3))
    return (k1 + 3 * (k2 + k3) + k4) * dt * 0.125


def _interpolate(t0: Tensor, t1: Tensor, y0: Tensor, y1: Tensor, t: Tensor) -> Tensor:
    """torchdiffeq's linear interpolation between the ends of a step (float64 0-d times)."""
    if t == t0:
        return y0
    if t == t1:
        return y1
    return y0 + (t - t0) / (t1 - t0) * (y1 - y0)


def integrate(
    recorder: StepRecorder, x0: Tensor, grid: Tensor, method: str, step_size: float | None, save_all: bool
) -> Tensor:
    """Integrate from ``x0`` ``(*batch, N, D)`` over ``grid`` ``(T,)`` (float64) by ``method``.

    Returns the states at the times ``grid``, ``(T, *batch, N, D)``, if ``save_all``, else the final state as
    ``(1, *batch, N, D)``. Calls ``recorder.start_step`` at the start of every step, where torchdiffeq's loop calls
    its ``callback_step`` (the recorder counts the step, keeps its start, watches growth and finiteness, and raises
    where it would), and adds the step's evaluations to ``recorder.progress.sample_evaluations``.
    """
    field, progress = recorder.field, recorder.progress
    times = step_grid(grid, step_size)
    steps = len(times) - 1
    # every 0-d time the loop hands on, taken apart once (indexing a tensor inside the loop costs microseconds a step)
    if type(field) is ETField:  # autonomous: it never reads the time (building the stage times costs 20 us a solve)
        stage_times = [(None,) * _STAGES[method]] * steps
    else:
        stage_times = list(
            zip(*(column.unbind() for column in _stage_times(times, method, x0.dtype).unbind(1)), strict=True)
        )
    step_sizes, step_starts = (times[1:] - times[:-1]).unbind(), times.unbind()
    on_grid = times is grid  # the outputs are the steps themselves
    time_values, outputs = times.tolist(), grid.tolist()
    samples_per_step = _STAGES[method] * x0.shape[:-2].numel()
    in_place = not torch.is_grad_enabled()
    scale_in_place = in_place and type(field) is ETField  # whose forward returns a new tensor (a subclass might not)
    fresh = recorder.keep_steps  # every step's start is kept: a new tensor per step
    saved = None  # as torchdiffeq: one tensor, every output assigned to its row (the same autograd graph)
    if save_all:
        saved = torch.empty((len(grid), *x0.shape), dtype=x0.dtype, device=x0.device)
        saved[0] = x0
    y = x0
    next_output = 1
    for k in range(steps):
        dt = step_sizes[k]
        recorder.start_step(time_values[k], y)
        progress.sample_evaluations += samples_per_step
        dy = _increment(method, field, stage_times[k], dt, y, scale_in_place)
        if not in_place:
            y1 = y + dy
        elif on_grid and saved is not None and not fresh:
            y1 = torch.add(y, dy, out=saved[k + 1])
        else:  # the increment is this step's own new tensor, still in cache: y + dy written into it, the same bits
            y1 = dy.add_(y)
        if saved is not None and not (on_grid and in_place and not fresh):
            while next_output < len(outputs) and time_values[k + 1] >= outputs[next_output]:
                saved[next_output] = _interpolate(step_starts[k], step_starts[k + 1], y, y1, grid[next_output])
                next_output += 1
        y = y1
    return y[None] if saved is None else saved
