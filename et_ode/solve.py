"""One solve function for the ET dynamics, returning a :class:`Solution` with its statistics.

``solve`` wraps torchdiffeq: every torchdiffeq method, the paper's Euler scheme (``method="et"``),
stopping at the attractor (``steady_state``), and three ways to differentiate (``grad``). The paper's scheme and
euler, midpoint and rk4 without a stopping test run in :mod:`et_ode.fixed_step`'s lean loop instead (the same
arithmetic as torchdiffeq's, bit for bit, without its per-step bookkeeping).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn
from torchdiffeq import odeint, odeint_adjoint, odeint_event

from ._checks import all_finite, check_mask, check_normalisable, check_precision, check_tokens
from .field import ETField, Evaluations
from .fixed_step import applies as lean_loop_applies
from .fixed_step import integrate as integrate_fixed_steps
from .manifold import radial_direction, tangent_projection

ADAPTIVE_METHODS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")
FIXED_METHODS = ("euler", "midpoint", "rk4", "explicit_adams", "implicit_adams")
METHODS = (*ADAPTIVE_METHODS, *FIXED_METHODS, "et")
GRADIENTS = ("direct", "adjoint", "implicit")
SAVES = ("all", "steps", "final")
GROWTH_WARNING = 1e3  # a fixed step that grows max |x| more than this many times warns (RuntimeWarning)


class Status(str, Enum):
    """How a solve ended."""

    REACHED_END = "reached_end"
    STEADY_STATE = "steady_state"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass
class SolveStats:
    """Statistics of one solve.

    ``nfe_backward`` counts the field evaluations made after the forward solve returned (the
    adjoint's backward pass, or the implicit solver's Hessian-vector products), so read it after
    ``loss.backward()``. ``sample_evaluations`` adds up the batch size of every forward evaluation: with
    ``per_sample=True`` converged samples leave the batch, so it falls below ``nfe_forward * batch``.
    ``stop_times`` (with ``steady_state``) holds the time at which each sample stopped, shape ``(*batch,)``;
    ``steady_state_measure`` names the quantity the stop tested (``"dg_dt"``: RMS ``|dg/dt|``;
    ``"tangent_gradient"``: RMS ``|T dE/dg|``), ``None`` without ``steady_state``.
    """

    nfe_forward: int
    accepted_steps: int
    rejected_steps: int
    wall_time: float
    t_final: float
    status: Status
    evaluations: Evaluations = dataclasses.field(repr=False)
    nfe_at_return: int = dataclasses.field(repr=False)
    sample_evaluations: int = 0
    stop_times: Tensor | None = None
    steady_state_measure: str | None = None

    @property
    def nfe_backward(self) -> int:
        return self.evaluations.count - self.nfe_at_return

    def as_dict(self) -> dict[str, Any]:
        return {"nfe_forward": self.nfe_forward, "nfe_backward": self.nfe_backward,
                "accepted_steps": self.accepted_steps, "rejected_steps": self.rejected_steps,
                "wall_time": self.wall_time, "t_final": self.t_final, "status": self.status.value,
                "sample_evaluations": self.sample_evaluations,
                "stop_times": None if self.stop_times is None else self.stop_times.tolist(),
                "steady_state_measure": self.steady_state_measure}


@dataclass
class Solution:
    """What a solve returns.

    Attributes:
        ts: saved times, ``(T,)``.
        xs: saved states ``(T, *batch, N, D)``, or ``None`` with ``save="final"``.
        energies: energy per sample at the saved times, ``(T, *batch)`` (detached, computed when first read).
        x: final state ``(*batch, N, D)``; differentiable with ``grad`` "direct" and "adjoint".
        g: final normalized state ``LayerNorm(x)``, ``(*batch, N, D)``; differentiable in every mode.
        residual: RMS of ``dg/dt`` per sample at the final state, ``(*batch,)`` (detached, computed when first read).
        stats: :class:`SolveStats`.
        field: the field that was integrated (with its mask).
    """

    ts: Tensor
    xs: Tensor | None
    x: Tensor
    g: Tensor
    stats: SolveStats
    field: ETField = dataclasses.field(repr=False)

    @property
    def mask(self) -> Tensor | None:
        return self.field.mask

    @property
    def status(self) -> Status:
        return self.stats.status

    @functools.cached_property
    def energies(self) -> Tensor:
        """Energy per sample at the saved times, ``(T, *batch)``, computed on first access (detached)."""
        states = self.x.detach()[None] if self.xs is None else self.xs.detach()
        model = self.field.model
        with torch.no_grad():
            return model._energy_g(model.neuron(states), self.field.mask)

    @functools.cached_property
    def residual(self) -> Tensor:
        """RMS of ``dg/dt`` per sample at the final state, ``(*batch,)``, computed on first access (detached)."""
        with torch.no_grad():
            return self.field.rms_dg_dt(self.x.detach())


class SolveError(RuntimeError):
    """A solve that could not finish. ``solution`` holds what was computed up to ``time``."""

    def __init__(self, message: str, *, time: float, solution: Solution | None):
        super().__init__(message)
        self.time = time
        self.solution = solution


@dataclass
class _Progress:
    """What the solver did, shared by the recorders of one solve."""

    steps: int = 0
    accepted: int = 0
    rejected: int = 0
    sample_evaluations: int = 0
    last_dt: float | None = None
    backward_steps: int = 0
    largest_growth: float = 1.0  # largest ratio of max |x| after and before one fixed step
    last_scale: float | None = None
    last: tuple[float, Tensor] | None = None
    saved: list[tuple[float, Tensor]] = dataclasses.field(default_factory=list)


class _Recorder(nn.Module):
    """Wraps the field for torchdiffeq, counting steps and catching runaway or non-finite solves."""

    saves_each_step = True  # fixed-step solvers accept every step

    def __init__(self, field: ETField, max_steps: int, keep_steps: bool, progress: _Progress):
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
        if (last is not None and last[0] is x and last[1] == x._version and last[2] == torch.is_grad_enabled()
                and last[4] == last[3]._version):
            return last[3]
        self.progress.sample_evaluations += x.shape[:-2].numel()
        velocity = self.field(t, x)
        self._last = (x, x._version, torch.is_grad_enabled(), velocity, velocity._version)
        return velocity

    def callback_step(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        progress = self.progress
        progress.steps += 1
        progress.last = (float(t0.detach()), y0.detach())
        if self.keep_steps and self.saves_each_step:
            progress.saved.append(progress.last)
        low, high = (float(v) for v in torch.aminmax(y0.detach()))  # one pass for both checks below
        if self.saves_each_step:  # fixed steps: watch the state's growth (no step control catches a blow-up)
            scale = max(-low, high)  # max |x|
            if progress.last_scale:
                progress.largest_growth = max(progress.largest_growth, scale / progress.last_scale)
            progress.last_scale = scale
        if not (math.isfinite(low) and math.isfinite(high)):
            raise _Failure(f"the state became non-finite (NaN or inf) by t={progress.last[0]:.6g}", progress.last[0])
        if progress.steps > self.max_steps:
            raise _Failure(f"max_steps={self.max_steps} solver steps exceeded at t={progress.last[0]:.6g}",
                           progress.last[0])

    def callback_step_adjoint(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        """Bounds the adjoint's backward solve by ``max_steps`` of its own; raised out of ``loss.backward()``."""
        progress = self.progress
        progress.backward_steps += 1
        states = y0 if isinstance(y0, (tuple, list)) else (y0,)
        finite = all(bool(torch.isfinite(s).all()) for s in states)
        underflow = not bool(t0 + dt > t0)  # torchdiffeq would assert next, printing the whole state
        if progress.backward_steps > self.max_steps or not finite or underflow:
            what = (f"more than max_steps={self.max_steps} steps" if progress.backward_steps > self.max_steps
                    else "a non-finite adjoint state" if not finite else f"underflow in its step size {float(dt):.3g}")
            raise SolveError(f"the adjoint's backward solve failed at t={float(t0):.6g}: {what} (the forward solve "
                             f"took {progress.steps} steps); the backward dynamics are stiffer than the forward: "
                             f"raise max_steps, loosen adjoint_rtol/adjoint_atol, use seminorm=True, or grad='direct'",
                             time=float(t0), solution=None)


class _AdaptiveRecorder(_Recorder):
    saves_each_step = False

    def callback_accept_step(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        self.progress.accepted += 1
        self.progress.last_dt = float(dt.detach())
        if self.keep_steps:
            self.progress.saved.append((float(t0.detach()), y0.detach()))

    def callback_reject_step(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        self.progress.rejected += 1


class _Failure(Exception):
    def __init__(self, message: str, time: float):
        super().__init__(message)
        self.time = time


def _time_grid(t: Tensor | Sequence[float] | None, method: str, step: float | None, steps: int | None,
               tau: float, device: torch.device) -> Tensor:
    if method == "et":
        if t is not None and not isinstance(t, (tuple, list)):
            raise ValueError("method='et' builds its grid from step and steps; give t=None or t=(t0,)")
        if step is None or steps is None:
            raise ValueError("method='et' needs step (alpha, e.g. 0.1) and steps (e.g. 12)")
        if not (step > 0) or not (isinstance(steps, int) and steps >= 1):
            raise ValueError(f"method='et' needs step > 0 and an integer steps >= 1, got step={step}, steps={steps}")
        t0 = float(t[0]) if t else 0.0
        return t0 + torch.arange(steps + 1, dtype=torch.float64, device=device) * (step * tau)
    if t is None:
        raise ValueError("t is required: a 1-D tensor of output times or a pair (t0, t1)")
    grid = torch.as_tensor(t, dtype=torch.float64).to(device).detach()
    if grid.dim() != 1 or grid.numel() < 2:
        raise ValueError(f"t must be a 1-D tensor of at least 2 times or a pair (t0, t1), got shape {tuple(grid.shape)}")
    if not bool(torch.isfinite(grid).all()) or not bool((grid[1:] > grid[:-1]).all()):
        raise ValueError(f"t must be finite and strictly increasing, got {grid.tolist()}")
    return grid


def solve(
    field: ETField,
    x0: Tensor,
    t: Tensor | Sequence[float] | None = None,
    *,
    method: str = "dopri5",
    rtol: float = 1e-5,
    atol: float = 1e-6,
    step: float | None = None,
    steps: int | None = None,
    options: dict[str, Any] | None = None,
    grad: str = "direct",
    adjoint_rtol: float | None = None,
    adjoint_atol: float | None = None,
    adjoint_method: str | None = None,
    seminorm: bool = False,
    implicit_tol: float = 1e-8,
    implicit_max_iter: int = 200,
    steady_state: float | None = None,
    steady_state_measure: str = "dg_dt",
    per_sample: bool = False,
    max_steps: int = 10_000,
    mask: Tensor | None = None,
    save: str = "all",
) -> Solution:
    """Integrate ``tau dx/dt = -dE/dg`` from ``x0`` of shape ``(*batch, N, D)``.

    Args:
        field: the vector field (its bound mask is used unless ``mask`` is given).
        x0: initial state ``(*batch, N, D)``.
        t: 1-D tensor of output times, or ``(t0, t1)``. ``None`` with ``method="et"``.
        method: a torchdiffeq method (adaptive: dopri5, dopri8, bosh3, fehlberg2, adaptive_heun;
            fixed: euler, midpoint, rk4, explicit_adams, implicit_adams) or ``"et"``, the paper's
            scheme: ``steps`` Euler steps of size ``step * tau`` (``x <- x - step * dE/dg``).
        rtol, atol: tolerances of adaptive methods.
        step: step size of fixed methods (``options["step_size"]``); the alpha of ``method="et"``.
            A fixed method without a step steps on the grid ``t`` itself.
        steps: number of steps of ``method="et"``.
        options: further torchdiffeq solver options.
        grad: ``"direct"`` (backpropagate through the solver), ``"adjoint"`` (torchdiffeq's adjoint,
            memory independent of the steps) or ``"implicit"`` (implicit function theorem at the
            fixed point; needs ``steady_state`` and gives gradients through ``Solution.g`` only).
        adjoint_rtol, adjoint_atol, adjoint_method, seminorm: the adjoint's backward solve.
        implicit_tol, implicit_max_iter: the conjugate-gradient solve of the implicit adjoint system.
        steady_state: stop once the RMS of ``dg/dt`` of every sample is below this value (or at the
            end of ``t``, whichever is first); gradients flow through the stopping time.
        steady_state_measure: ``"dg_dt"`` (RMS of ``dg/dt``, the default) or ``"tangent_gradient"``
            (RMS of the energy gradient along the per-token spheres, ``T dE/dg``: scale-free, since
            ``|dg/dt|`` also shrinks as ``|x|`` drifts outward; see :mod:`et_ode.manifold`).
        per_sample: with ``steady_state``, every sample stops at its own crossing and leaves the batch,
            so converged samples stop costing work (``stats.sample_evaluations``, ``stats.stop_times``).
            Needs ``x0`` of shape ``(batch, N, D)`` and ``save="final"``.
        max_steps: raise :class:`SolveError` after this many solver steps; with ``grad="adjoint"`` the backward
            solve has a budget of its own of as many steps (its SolveError comes out of ``loss.backward()``).
        mask: attention mask ``(N, N)`` or ``(*batch, N, N)``.
        save: ``"all"`` (the states at the times ``t``; with ``steady_state``, those before the stop
            and the stop itself, recomputed without gradients), ``"steps"`` (every accepted step of
            an adaptive method, every step of a fixed one) or ``"final"``.

    Raises:
        TypeError: ``field`` is not an ETField; ``x0`` or ``mask`` of the wrong type or dtype (``x0`` must have the
            model's dtype).
        ValueError: a bad argument, named: unknown ``method``/``grad``/``save``, bad tolerances or ``t``; ``x0`` of
            the wrong shape, with N = 0 or an empty batch, non-finite, too large for its dtype (the LayerNorm's
            variance overflows: use float64), half precision with an adaptive method, or on another device.
        SolveError: too many steps (``method="et"`` and fixed steps are checked before any work), step-size
            underflow, or a non-finite state (the message says where and what to try); ``error.solution`` holds
            the partial solution (``status`` FAILED). The adjoint's backward solve raises it from
            ``loss.backward()`` when it exceeds ``max_steps`` (then ``solution`` is None).
    """
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    if grad not in GRADIENTS:
        raise ValueError(f"grad must be one of {GRADIENTS}, got {grad!r}")
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    if not (rtol > 0 and atol > 0):
        raise ValueError(f"rtol and atol must be positive, got rtol={rtol}, atol={atol}")
    if steady_state is not None and not steady_state > 0:
        raise ValueError(f"steady_state must be a positive tolerance, got {steady_state!r}")
    if steady_state_measure not in _MEASURES:
        raise ValueError(f"steady_state_measure must be one of {tuple(_MEASURES)}, got {steady_state_measure!r}")
    if per_sample and (steady_state is None or save != "final" or x0.dim() != 3):
        raise ValueError("per_sample=True needs steady_state=tol, save='final' and x0 of shape (batch, N, D); got "
                         f"steady_state={steady_state}, save={save!r}, x0 shape {tuple(x0.shape)}")
    if not (isinstance(max_steps, int) and max_steps >= 1):
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
    if grad == "implicit" and steady_state is None:
        raise ValueError("grad='implicit' differentiates at a fixed point: give steady_state=tol")
    check_tokens("x0", x0, field.model.dim, like=field.model.neuron.delta)
    if x0.shape[:-2].numel() == 0:
        raise ValueError(f"x0 has an empty batch: shape {tuple(x0.shape)} (*batch, N, D); give at least one sample")
    check_normalisable("x0", x0)
    check_precision("x0", x0, method, method in ADAPTIVE_METHODS)
    if method == "et" and isinstance(steps, int) and steps > max_steps:  # before building a grid of steps + 1 times
        raise SolveError(f"solve failed (et): steps={steps} is more than max_steps={max_steps}; raise max_steps or "
                         f"take fewer, larger steps", time=float(t[0]) if isinstance(t, (tuple, list)) and t else 0.0,
                         solution=_partial_solution(field, _Progress(), x0, field.evaluations,
                                                    field.nfe, 0.0))
    if mask is not None:
        field = field.with_mask(check_mask(mask, x0))
    else:
        check_mask(field.mask, x0)
    grid = _time_grid(t, method, step, steps, field.tau, x0.device)

    torch_method = "euler" if method == "et" else method
    opts = dict(options or {})
    if method == "et":
        if steady_state is not None:  # the event loop of fixed solvers needs a step size; else step on the grid
            opts["step_size"] = step * field.tau
    elif step is not None:
        if method in ADAPTIVE_METHODS:
            raise ValueError(f"step is for fixed-step methods; {method!r} is adaptive (use rtol/atol, or options)")
        opts["step_size"] = float(step)
    if steady_state is not None and torch_method in FIXED_METHODS and "step_size" not in opts:
        raise ValueError(f"steady_state with the fixed-step method {method!r} needs step=...")

    adaptive = torch_method in ADAPTIVE_METHODS
    fixed_step = opts.get("step_size")
    if not adaptive:
        planned = len(grid) - 1 if fixed_step is None else int(torch.ceil((grid[-1] - grid[0]) / fixed_step))
        if planned > max_steps:
            raise SolveError(f"solve failed ({method}): {planned} fixed steps planned from t={float(grid[0]):.6g} to "
                             f"{float(grid[-1]):.6g}, more than max_steps={max_steps}", time=float(grid[0]),
                             solution=_partial_solution(field, _Progress(), x0, field.evaluations,
                                                        field.nfe, 0.0))
    progress = _Progress()
    recorder_type = _AdaptiveRecorder if adaptive else _Recorder
    recorder = recorder_type(field, max_steps, keep_steps=save == "steps", progress=progress)
    evaluations = field.evaluations
    nfe_before = evaluations.count
    kwargs: dict[str, Any] = dict(rtol=rtol, atol=atol, method=torch_method, options=opts)
    if grad == "adjoint":
        interface = odeint_adjoint
        kwargs.update(adjoint_params=tuple(field.parameters()), adjoint_rtol=adjoint_rtol or rtol,
                      adjoint_atol=adjoint_atol or atol, adjoint_method=adjoint_method,
                      adjoint_options=dict(norm="seminorm") if seminorm else None)
    else:
        interface = odeint

    started = time.perf_counter()
    status = Status.REACHED_END
    try:
        with torch.no_grad() if grad == "implicit" else contextlib.nullcontext():
            stop_times = None
            if steady_state is None and grad == "direct" and lean_loop_applies(torch_method, opts):
                xs = integrate_fixed_steps(recorder, x0, grid, torch_method, fixed_step, save_all=save == "all")
                ts, x_final = grid, xs[-1]
            elif steady_state is None:
                xs = interface(recorder, x0, grid, **kwargs)
                ts, x_final = grid, xs[-1]
            else:
                x_final, stop_times, status = _solve_to_steady_state(
                    recorder, x0, grid, steady_state, interface, kwargs, _MEASURES[steady_state_measure], per_sample)
                t_stop = float(stop_times.max())
                ts, xs = grid[grid < t_stop], None
                ts = torch.cat([ts, ts.new_tensor([t_stop])])
    except (_Failure, AssertionError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and "Reached maximum number of iterations" not in str(error):
            raise
        last_time = progress.last[0] if progress.last else float(grid[0])
        fail_time = error.time if isinstance(error, _Failure) else last_time
        partial = _partial_solution(field, progress, x0, evaluations, nfe_before, time.perf_counter() - started)
        raise SolveError(f"solve failed ({method}): {error}{_advice(str(error))}", time=fail_time,
                         solution=partial) from error
    wall_time = time.perf_counter() - started
    nfe_forward = evaluations.count - nfe_before
    if not all_finite(x_final):
        partial = _partial_solution(field, progress, x0, evaluations, nfe_before, wall_time)
        raise SolveError(f"solve failed ({method}): the state became non-finite (NaN or inf) by "
                         f"t={float(ts[-1]):.6g}{_advice('non-finite')}", time=float(ts[-1]), solution=partial)
    if not adaptive and progress.largest_growth > GROWTH_WARNING:
        warnings.warn(f"solve ({method}): one fixed step grew the state {progress.largest_growth:.3g}-fold (largest "
                      f"|x|): the step is far too large for this field (stiff, or large weights), so the result is "
                      f"not an accurate solution and the state heads for overflow. Use a smaller step, more steps, "
                      f"or an adaptive method", RuntimeWarning, stacklevel=2)
    if not adaptive and steady_state is not None:  # torchdiffeq's fixed-step event loop has no step callback
        progress.steps = round((float(ts[-1]) - float(grid[0])) / fixed_step)

    if grad == "implicit":
        if status is not Status.STEADY_STATE:
            raise SolveError(
                f"grad='implicit' needs a converged fixed point, but the solve reached t={float(ts[-1]):.6g} "
                f"without {_MEASURE_NAMES[steady_state_measure]} < {steady_state}; integrate longer or loosen "
                "steady_state", time=float(ts[-1]), solution=None)
        from .attractor import find_attractor

        # polish the end state into a certified attractor, and differentiate there (exactly)
        attractor = find_attractor(field, x_final.detach(), flow=False, implicit_tol=implicit_tol,
                                   implicit_max_iter=implicit_max_iter)
        if not bool(attractor.certified.all()):
            raise SolveError(
                f"grad='implicit': the end state did not polish into a certified stable attractor (kinds "
                f"{attractor.kind}, RMS gradient {attractor.gradient.flatten().tolist()}); the implicit gradient is "
                "defined only there", time=float(ts[-1]), solution=None)
        g_final, x_final = attractor.g, attractor.x
    else:
        g_final = field.model.neuron(x_final)

    with torch.no_grad():
        if save == "all" and xs is None:  # steady state: the saved grid up to the stop
            xs = torch.stack([x0.detach(), x_final.detach()])
            if len(ts) > 2:  # recompute the intermediate times without gradients (costs a second solve)
                solver_args = {k: kwargs[k] for k in ("rtol", "atol", "method", "options")}
                xs = torch.cat([odeint(field, x0.detach(), ts[:-1], **solver_args), xs[-1:]])
        elif save == "steps":
            ts, xs = _steps_saved(progress, ts, x0, x_final)
        elif save == "final":
            ts, xs = ts[-1:], None
    stats = SolveStats(nfe_forward=nfe_forward,
                       accepted_steps=progress.accepted if adaptive else progress.steps,
                       rejected_steps=progress.rejected, wall_time=wall_time, t_final=float(ts[-1]),
                       status=status, evaluations=evaluations, nfe_at_return=evaluations.count,
                       sample_evaluations=progress.sample_evaluations, stop_times=stop_times,
                       steady_state_measure=None if steady_state is None else steady_state_measure)
    return Solution(ts=ts, xs=xs, x=x_final, g=g_final, stats=stats, field=field)


def _advice(text: str) -> str:
    """What to try after a failed solve, from the text of its cause."""
    if "non-finite" in text or "underflow in dt" in text:
        return ("; the dynamics overflowed or became too stiff for the solver there: use float64 (x0 and model), "
                "a smaller step, tighter rtol/atol, or smaller weights")
    if "max_steps" in text or "Reached maximum" in text:
        return "; raise max_steps, loosen rtol/atol, or shorten the horizon"
    return ""


def _rms_dg_dt(field: ETField, x: Tensor, velocity: Tensor | None = None) -> Tensor:
    # unchecked on purpose: the event calls this every step; the state was validated once and the recorder
    # catches non-finite states. ``field(...)`` counts the evaluation the solve pays for, when it pays one.
    if velocity is None:
        velocity = field(None, x)
    return field.model.neuron.hessian_vector(x, velocity).square().mean(dim=(-1, -2)).sqrt()


def _rms_tangent_gradient(field: ETField, x: Tensor, velocity: Tensor | None = None) -> Tensor:
    g = field.model.neuron(x)
    if velocity is None:
        field.evaluations.count += 1
        grad = field.dE_dg(g)
    else:
        grad = velocity * -field.tau  # dx/dt = -dE/dg / tau
    s, _ = radial_direction(g, field.model.neuron.delta)
    return tangent_projection(grad, s).square().mean(dim=(-1, -2)).sqrt()


_MEASURES: dict[str, Callable[[ETField, Tensor, Tensor | None], Tensor]] = {
    "dg_dt": _rms_dg_dt,
    "tangent_gradient": _rms_tangent_gradient,
}
_MEASURE_NAMES = {"dg_dt": "RMS |dg/dt|", "tangent_gradient": "RMS |T dE/dg|"}


class _StopTimeParameterTerm(torch.autograd.Function):
    """Identity on the state at a steady-state stop; its backward adds the stop test's direct dependence on the
    parameters, which torchdiffeq's ``odeint_event`` drops (it carries the stop time's gradient through the state).

    The stop time ``t*`` solves ``c(x(t*), theta) = 0``, so ``dt*/dtheta|direct = -(dc/dtheta) / (dc/dt)`` with
    ``dc/dt = dc/dx . f + dc/dt|explicit``, and the loss sees ``t*`` through ``x(t*)``: ``dL/dt* = dL/dx . f``.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, t_event: Tensor, event_fn: Callable[[Tensor, Tensor], Tensor],
                velocity: Callable[[Tensor], Tensor], *params: Tensor) -> Tensor:
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


def _solve_to_steady_state(recorder: _Recorder, x0: Tensor, grid: Tensor, tol: float, interface: Any,
                           kwargs: dict[str, Any], measure: Callable[[ETField, Tensor, Tensor | None], Tensor],
                           per_sample: bool) -> tuple[Tensor, Tensor, Status]:
    """Integrate until every sample's ``measure`` is below ``tol``, or to ``grid[-1]``.

    Jointly (``per_sample=False``): one event, the largest measure of the batch crossing ``tol``. Per sample:
    the smallest measure among the samples still running crosses ``tol``; those that converged leave the
    batch and the rest continue from there, each segment a solve of its own on the remaining samples.
    Returns the final states, each sample's stopping time ``(*batch,)`` and the status.
    """
    field, t_end = recorder.field, grid[-1]
    batch_shape = x0.shape[:-2]
    stop_times = torch.full(batch_shape, float(t_end), dtype=grid.dtype)
    finals: list[Tensor | None] = [None] * (x0.shape[0] if per_sample else 1)
    active = torch.arange(len(finals))
    x, t_start = x0, grid[0]
    while len(active):
        segment_field = field
        if per_sample and field.mask is not None and field.mask.dim() == 3:
            segment_field = field.with_mask(field.mask[active])
        segment = type(recorder)(segment_field, recorder.max_steps, recorder.keep_steps, recorder.progress)
        with torch.no_grad():
            converged = measure(segment_field, x, segment.velocity(x)) < tol
        if not per_sample:
            converged = converged.all().reshape(1)
        if not bool(converged.any()):  # (samples converged at a segment's start stop before integrating)
            def event_fn(t: Tensor, y: Tensor, segment_field: ETField = segment_field,
                         segment: _Recorder = segment) -> Tensor:
                values = measure(segment_field, y, segment.velocity(y))
                crossing = torch.log((values.min() if per_sample else values.max()) / tol)
                return torch.minimum(crossing, (t_end - t).to(crossing.dtype))

            segment_kwargs = kwargs
            if recorder.progress.last_dt is not None:  # continue with the step size the last segment reached
                options = dict(kwargs["options"], first_step=recorder.progress.last_dt)
                segment_kwargs = dict(kwargs, options=options)
            t_event, xs = odeint_event(segment, x, t_start, event_fn=event_fn, odeint_interface=interface,
                                       **segment_kwargs)
            t_start, x = t_event.detach(), xs[-1]
            params = tuple(p for p in field.parameters() if p.requires_grad)
            if torch.is_grad_enabled() and params:  # the stop test's own dependence on the parameters
                x = _StopTimeParameterTerm.apply(x, t_start, event_fn, functools.partial(segment.field, None),
                                                 *params)
            with torch.no_grad():
                converged = measure(segment_field, x, segment.velocity(x)) < tol * (1 + 1e-6)
            if not per_sample:
                converged = converged.all().reshape(1)
            if float(t_start) >= float(t_end) * (1 - 1e-12) or not bool(converged.any()):
                converged = torch.ones_like(converged)  # the end of the time span: everyone stops
        for position in torch.nonzero(converged).flatten().tolist():
            index = int(active[position])
            finals[index] = x[position] if per_sample else x
            stop_value = min(float(t_start), float(t_end))
            if per_sample:
                stop_times[index] = stop_value
            else:
                stop_times.fill_(stop_value)
        keep = ~converged
        active, x = active[keep], (x[keep] if per_sample else x)
    x_final = torch.stack(finals) if per_sample else finals[0]
    with torch.no_grad():
        reached = bool((measure(field, x_final, recorder.velocity(x_final)) < tol * (1 + 1e-6)).all())
    status = Status.STEADY_STATE if reached and float(stop_times.max()) < float(t_end) else Status.REACHED_END
    return x_final, stop_times, status


def _steps_saved(progress: _Progress, ts: Tensor, x0: Tensor, x_final: Tensor) -> tuple[Tensor, Tensor]:
    """The start of every accepted step, then the final state."""
    times = [t for t, _ in progress.saved] + [float(ts[-1])]
    states = [s for _, s in progress.saved] + [x_final.detach()]
    if not progress.saved or times[0] > float(ts[0]):
        times.insert(0, float(ts[0]))
        states.insert(0, x0.detach())
    return torch.tensor(times, dtype=ts.dtype, device=ts.device), torch.stack(states)


def _partial_solution(field: ETField, progress: _Progress, x0: Tensor, evaluations: Evaluations, nfe_before: int,
                      wall_time: float) -> Solution:
    t_last, x_last = progress.last if progress.last is not None else (0.0, x0.detach())
    ts = torch.tensor([t_last], dtype=torch.float64)
    with torch.no_grad():
        g = field.model.neuron(x_last)
    stats = SolveStats(nfe_forward=evaluations.count - nfe_before, accepted_steps=progress.accepted or progress.steps,
                       rejected_steps=progress.rejected, wall_time=wall_time, t_final=t_last, status=Status.FAILED,
                       evaluations=evaluations, nfe_at_return=evaluations.count,
                       sample_evaluations=progress.sample_evaluations)
    return Solution(ts=ts, xs=x_last[None], x=x_last, g=g, stats=stats, field=field)
