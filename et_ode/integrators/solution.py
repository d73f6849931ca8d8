"""What :func:`et_ode.solve` returns: the :class:`Solution` with its :class:`SolveStats`, or a :class:`SolveError`."""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from et_ode.dynamics.field import ETField
from et_ode.energy.masks import Mask

#: what a solve keeps: the states at the times ``t``, at every step, or the final state only
Save = Literal["all", "steps", "final"]
SAVES: tuple[Save, ...] = get_args(Save)
#: what a steady-state stop measures: RMS |dg/dt| or RMS |T dE/dg| (et_ode.SteadyState)
Measure = Literal["dg_dt", "tangent_gradient"]


class Status(str, Enum):
    """How a solve ended.

    Attributes:
        REACHED_END: the solve reached the last output time without its stop.
        STEADY_STATE: the stopping rule held for every sample before the last output time (or, for an
            :class:`~et_ode.AttractorReadout`, every sample is certified).
        FAILED: the integration could not go on (a partial solution of :class:`SolveError`).
    """

    REACHED_END = "reached_end"
    STEADY_STATE = "steady_state"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class BackwardTally:
    """The field evaluations made by the backward passes through one solve's outputs, fixed as each pass ends.

    A pass opens the tally when its gradient reaches the solution (:func:`tally_backward`), in the thread that runs
    that part of the backward, and closes it when the whole pass has finished (the autograd engine's end-of-pass
    callback), adding the evaluations that thread made in between. Nothing read later changes it: other solves,
    ``reset_nfe()``, other threads. Evaluations of the same field by another solve's backward in the same pass are
    counted by both.
    """

    def __init__(self, field: ETField):
        self.evaluations = field.evaluations
        self.count = 0
        self._open: tuple[int, int] | None = None  # (thread, its evaluations when the pass reached the solution)
        self._lock = threading.Lock()

    def open(self) -> None:
        """Called when a backward pass reaches the solution (:func:`tally_backward`): starts the count for this pass."""
        with self._lock:
            if self._open is not None:
                return
            thread = threading.get_ident()
            self._open = (thread, self.evaluations.made_by(thread))
        torch.autograd.Variable._execution_engine.queue_callback(self.close)

    def close(self) -> None:
        """The end of the pass: adds its evaluations."""
        with self._lock:
            if self._open is None:
                return
            thread, start = self._open
            self.count += self.evaluations.made_by(thread) - start
            self._open = None


def tally_backward(x: Tensor | None, tally: BackwardTally) -> None:
    """Open ``tally`` when a backward pass reaches ``x`` (a hook on ``x``); nothing when no gradient flows through
    ``x`` or it is a leaf (no solve behind it)."""
    if x is None or not x.requires_grad or x.grad_fn is None:
        return
    x.register_hook(lambda grad: tally.open())


@dataclass
class SolveStats:
    """Statistics of one solve.

    Attributes:
        nfe_forward: the field evaluations until ``solve`` returned, made by the thread that called it (solves in
            other threads sharing the field are not counted), the stopping test's and, with
            :class:`~et_ode.Implicit`, the polishing of the end state into an attractor included.
        accepted_steps: the solver's accepted steps (every step of a fixed-step method).
        rejected_steps: the adaptive solver's rejected steps.
        wall_time: the seconds of the same span as ``nfe_forward``.
        t_final: the time of the final state.
        status: how the solve ended (:class:`Status`).
        field: the integrated field.
        nfe_at_return: the field's ``nfe`` when the solve returned.
        sample_evaluations: the batch sizes of every forward evaluation, added up: with
            ``SteadyState(per_sample=True)`` converged samples leave the batch, so it falls below
            ``nfe_forward * batch``.
        stop_times: with a stop, the time at which each sample stopped, ``(*batch,)``; else None.
        steady_state_measure: the quantity the stop tested (``"dg_dt"``: RMS ``|dg/dt|``; ``"tangent_gradient"``:
            RMS ``|T dE/dg|``), None without a stop.
        nfe_backward: the field evaluations of the backward passes through the solution (the adjoint's backward
            solve, or the implicit solver's Hessian-vector products): 0 until a backward pass through
            ``Solution.x``, ``Solution.g`` or ``Solution.xs`` has finished, then fixed (:class:`BackwardTally`).
    """

    nfe_forward: int
    accepted_steps: int
    rejected_steps: int
    wall_time: float
    t_final: float
    status: Status
    field: ETField = dataclasses.field(repr=False)  # the field integrated
    nfe_at_return: int = dataclasses.field(repr=False)  # the field's ``nfe`` when the solve returned
    sample_evaluations: int = 0
    stop_times: Tensor | None = None
    steady_state_measure: Measure | None = None
    backward: BackwardTally = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.backward = BackwardTally(self.field)

    @property
    def nfe_backward(self) -> int:
        return self.backward.count

    def as_dict(self) -> dict[str, Any]:
        return {
            "nfe_forward": self.nfe_forward,
            "nfe_backward": self.nfe_backward,
            "accepted_steps": self.accepted_steps,
            "rejected_steps": self.rejected_steps,
            "wall_time": self.wall_time,
            "t_final": self.t_final,
            "status": self.status.value,
            "sample_evaluations": self.sample_evaluations,
            "stop_times": None if self.stop_times is None else self.stop_times.tolist(),
            "steady_state_measure": self.steady_state_measure,
        }


@dataclass
class Solution:
    """What a solve returns.

    Attributes:
        ts: saved times, ``(T,)``.
        xs: saved states ``(T, *batch, N, D)``, or ``None`` with ``save="final"``.
        energies: energy per sample at the saved times, ``(T, *batch)`` (detached, computed when first read).
        x: final state ``(*batch, N, D)``; differentiable with the gradients ``Direct`` and ``Adjoint``.
        g: final activation ``neuron(x)`` (``LayerNorm(x)`` for the ET), ``(*batch, N, D)``; differentiable with every
            gradient.
        residual: RMS of ``dg/dt`` per sample at the final state, ``(*batch,)`` (detached, computed when first read).
        stats: :class:`SolveStats`.
        field: the integrated field; its mask is ``mask``.
    """

    ts: Tensor
    xs: Tensor | None
    x: Tensor
    g: Tensor
    stats: SolveStats
    field: ETField = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        """A backward pass that reaches ``x``, ``g`` or ``xs`` opens ``stats.backward``."""
        for tensor in (self.x, self.g, self.xs):
            tally_backward(tensor, self.stats.backward)

    @property
    def mask(self) -> Mask:
        return self.field.mask

    @property
    def status(self) -> Status:
        return self.stats.status

    @functools.cached_property
    def energies(self) -> Tensor:
        """Energy per sample at the saved times, ``(T, *batch)``, computed on first access (detached)."""
        states = self.x.detach()[None] if self.xs is None else self.xs.detach()
        with torch.no_grad():
            return self.field.energy(states)

    @functools.cached_property
    def residual(self) -> Tensor:
        """RMS of ``dg/dt`` per sample at the final state, ``(*batch,)``, computed on first access (detached)."""
        with torch.no_grad():
            return self.field.rms_dg_dt(self.x.detach())


class SolveError(RuntimeError):
    """A solve that could not finish. ``solution`` holds the states computed up to ``time`` (None where there are none
    to give: the adjoint's backward solve, an implicit gradient without a fixed point).

    Args:
        message: why the solve stopped, with advice.
        time: the time the solve reached.
        solution: the states computed up to ``time``, or None.
    """

    def __init__(self, message: str, *, time: float, solution: Solution | None):
        super().__init__(message)
        self.time = time
        self.solution = solution


@dataclass
class Progress:
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
    bar: Any = None  # a tqdm bar over the time span, or None
    t0: float = 0.0  # the start of the time span (the bar counts from it)

    def reached(self, t: float) -> None:
        """The solve has got to time ``t``: the bar, if any, follows."""
        if self.bar is not None:
            self.bar.update(max(0.0, abs(t - self.t0) - self.bar.n))
