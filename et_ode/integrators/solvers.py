"""The solver settings of :func:`et_ode.solve`: small frozen objects that validate themselves on construction.

Three kinds, each naming what it needs and nothing else:

- :class:`Adaptive` (``method``, ``rtol``, ``atol``): torchdiffeq's embedded Runge-Kutta methods with step control.
- :class:`Fixed` (``method``, ``step_size``): torchdiffeq's fixed-step methods; without a ``step_size`` they step on
  the output grid ``t`` itself.
- :class:`EulerET` (``alpha``, ``steps``): the paper's scheme, ``steps`` updates ``x <- x - alpha dE/dg``, i.e.
  Euler steps of size ``alpha * tau``; it builds its own time grid.

A plain string names one where that is unambiguous (:func:`as_solver`): an adaptive method's name gives
``Adaptive(name)``, a fixed method's ``Fixed(name)``, ``"et"`` gives ``EulerET()``. The rules between a solver and
the other arguments of ``solve`` are methods of the solver (:meth:`~Adaptive.time_grid` checks ``t`` and the step
budget, :meth:`~Adaptive.check_stop` the stopping rule, :meth:`~Adaptive.check_state` the state's precision).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from et_ode.backend.validation import check_positive
from et_ode.integrators.fixed_step import step_grid

#: torchdiffeq's adaptive methods; et-ode's own loop runs dopri5, bosh3 and tsit5 (Adaptive.OWN_METHODS)
AdaptiveMethod = Literal["dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun"]
#: torchdiffeq's fixed-step methods
FixedMethod = Literal["euler", "midpoint", "rk4", "explicit_adams", "implicit_adams"]
#: the methods a name selects (as_solver); "et" is the paper's scheme (EulerET); tsit5 needs Adaptive("tsit5")
Method = Literal[AdaptiveMethod, FixedMethod, "et"]
ADAPTIVE_METHODS: tuple[AdaptiveMethod, ...] = get_args(AdaptiveMethod)
FIXED_METHODS: tuple[FixedMethod, ...] = get_args(FixedMethod)
METHODS: tuple[Method, ...] = get_args(Method)
# implicit_adams iterates its corrector to these tolerances; the other fixed methods ignore them
CORRECTOR_RTOL, CORRECTOR_ATOL = 1e-5, 1e-6


class SolverFailure(Exception):
    """An integration that cannot go on (a step budget exceeded, a non-finite state, a step-size underflow):
    raised by the solvers' checks and ``solve``'s step recorder; ``solve`` turns it into
    :class:`et_ode.SolveError` with the partial solution. ``time``: where it happened; ``advice``: what to try."""

    def __init__(self, message: str, time: float, advice: str = ""):
        super().__init__(message)
        self.time = time
        self.advice = advice


BUDGET_ADVICE = "raise max_steps, loosen rtol/atol, or shorten the horizon"


def _check_options(owner: str, options: object) -> None:
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"{owner}.options must be a dict of torchdiffeq solver options or None, got {type(options).__name__}"
        )


def output_grid(t: Tensor | Sequence[float] | None, device: torch.device) -> Tensor:
    """``t`` as a float64 grid ``(T,)`` of at least 2 finite, strictly increasing times (ValueError naming ``t``;
    TypeError naming it for values that are not numbers)."""
    if t is None:
        raise ValueError("t is required: a 1-D tensor of output times or a pair (t0, t1)")
    if isinstance(t, (str, bytes)) or (isinstance(t, Sequence) and any(isinstance(v, (str, bytes)) for v in t)):
        raise TypeError(f"t must hold numbers, got {t!r}")
    try:
        grid = torch.as_tensor(t, dtype=torch.float64).to(device).detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"t must be a 1-D tensor or sequence of numbers, got {t!r} ({error})") from None
    if grid.dim() != 1 or grid.numel() < 2:
        raise ValueError(f"t must be a 1-D tensor of at least 2 times or a pair (t0, t1), got shape {tuple(grid.shape)}")
    if not bool(torch.isfinite(grid).all()) or not bool((grid[1:] > grid[:-1]).all()):
        raise ValueError(f"t must be finite and strictly increasing, got {grid.tolist()}")
    return grid


@dataclass(frozen=True)
class Adaptive:
    """An adaptive embedded Runge-Kutta method with step-size control, run by torchdiffeq or by et-ode's own loop
    (:mod:`et_ode.integrators.adaptive_loop`).

    Args:
        method: one of :data:`ADAPTIVE_METHODS` (dopri5, dopri8, bosh3, fehlberg2, adaptive_heun); et-ode's loop
            runs :attr:`OWN_METHODS` (dopri5, bosh3, and tsit5, which only it runs).
        rtol, atol: the local error tolerances, positive.
        options: further torchdiffeq options (e.g. ``first_step``, ``max_num_steps``), or None; et-ode's loop takes
            ``first_step`` only.
        loop: ``"torchdiffeq"``, ``"et_ode"`` or ``"auto"`` (the default: et-ode's loop for its methods wherever
            it runs the solve, torchdiffeq's for the others; see :meth:`own_loop`).
        step_control: ``"shared"`` (one step size and error norm for the whole batch, torchdiffeq's semantics) or
            ``"per_sample"`` (et-ode's loop: each sample its own step size, accept/reject and end, and samples that
            are done leave the batch; ``stats.accepted_steps`` then adds up the samples' accepted steps).
        controller: ``"i"`` (the I-controller, torchdiffeq's) or ``"pid"`` (et-ode's loop: diffrax's PID form with
            the coefficients ``(pcoeff, icoeff, dcoeff) = (0.4, 0.3, 0)``).
        progress: et-ode's loop calls it after every step with each sample's time ``(B,)`` and number of accepted
            steps ``(B,)`` (CPU tensors, the batch flattened), or None. With ``compile=True``, it is called for each
            step in order after the compiled call that took it (weights it changes count from the next call on).
        cuda_graph: on CUDA, et-ode's loop captures one step (its stages, error and controller) in a CUDA graph after
            two steps and replays it for the rest, one kernel launch for the step's many small ones: shared steps (or
            those of a single sample) of an ET field without gradients or a stop; everywhere else the steps run as
            without. The field's weights must not change during the solve (e.g. from ``progress``); a field that cannot
            be captured gets a ``RuntimeWarning`` and the solve runs on without the graph.
        compile: how et-ode's loop runs a solve of an ET field without gradients or a stop (any batch and step
            control): ``"auto"`` (the default) in the native loop where it computes the field and no ``progress``
            callback is given, else step by step; ``True`` as compiled code, the native loop where it computes the
            field, else ``torch.compile``; ``False`` step by step. The native loop runs the whole solve (every step,
            the first stage and the first step's choice, the states at the saved times) in C, on the CPU, for an
            energy of an identity or LayerNorm neuron with one ``EnergyAttention`` and one ``HopfieldMemory``, without
            a mask, in float32 or float64: built once per machine with the system's C compiler (about a second, kept
            under ``$ET_ODE_CACHE`` or ``~/.cache/et_ode``; without a compiler it is not used), its matrix products
            in PyTorch's own BLAS; shared, the batch's passes between the products run on as many threads as its
            products; per sample, the samples step on the process's threads (each on one) and a sample at the end is
            not evaluated again. Elsewhere (a mask, another energy, a GPU, no C compiler) ``compile=True`` hands the
            solve to ``torch.compile`` as one ``while_loop`` (per sample, a sample at the end keeps its state while
            the others step on), compiled once per shape, dtype and setting in a process (tens of seconds on a CPU; it
            needs a C++ compiler there). Either way the solve runs in calls of a fraction of a second each (as many
            steps as the last call's time a step allows; the first call of a new shape one step), between which a
            progress bar (``solve(progress=True)``) moves and Ctrl-C lands; with a ``progress`` callback at most 64
            steps a call (each call logs its steps' times), with ``save="steps"`` a step a call. It evaluates the
            field's closed form, so states agree with the step-by-step loop to rounding, not bit for bit. On the CPU
            the compiled code uses at most one thread per 2048 elements of the state (in the native loop, of a group:
            the batch when shared, a sample per sample; PyTorch's thread count is set back after each call). A solve
            that ``torch.compile`` cannot compile, whatever the compiler raises, gets a ``RuntimeWarning`` and runs
            on without (inside the ``while_loop`` a view of a parameter, such as ``W.T`` in an energy, does not trace:
            write ``nn.functional.linear(g, W)``).

    et-ode's loop runs the gradients ``Direct`` and ``Adjoint`` (its backward solve on the same loop); for stops see
    :meth:`check_stop`.

    Raises:
        ValueError: an unknown ``method``, ``loop``, ``step_control`` or ``controller``; ``rtol`` or ``atol`` not
            positive; a setting of et-ode's loop with ``loop="torchdiffeq"``, or ``options`` it does not take;
            ``cuda_graph=True`` with ``compile=True``.
        TypeError: ``progress`` is not a callable or None; ``cuda_graph`` not a bool; ``compile`` not a bool or
            ``"auto"``.
    """

    method: AdaptiveMethod | Literal["tsit5"] = "dopri5"
    rtol: float = 1e-5
    atol: float = 1e-6
    options: Mapping[str, Any] | None = None
    loop: Literal["auto", "torchdiffeq", "et_ode"] = "auto"
    step_control: Literal["shared", "per_sample"] = "shared"
    controller: Literal["i", "pid"] = "i"
    progress: Callable[[Tensor, Tensor], None] | None = None
    cuda_graph: bool = False
    compile: bool | Literal["auto"] = "auto"

    adaptive: ClassVar[bool] = True
    OWN_METHODS: ClassVar[tuple[str, ...]] = ("dopri5", "bosh3", "tsit5")  # the methods et-ode's loop runs
    LOOPS: ClassVar[tuple[str, ...]] = ("auto", "torchdiffeq", "et_ode")
    STEP_CONTROLS: ClassVar[tuple[str, ...]] = ("shared", "per_sample")
    CONTROLLERS: ClassVar[tuple[str, ...]] = ("i", "pid")

    def __post_init__(self) -> None:
        if self.method not in ADAPTIVE_METHODS and self.method not in self.OWN_METHODS:
            raise ValueError(
                f"Adaptive.method must be one of {(*ADAPTIVE_METHODS, 'tsit5')}, got {self.method!r}"
                + (" (a fixed-step method: use Fixed)" if self.method in METHODS else "")
            )
        check_positive("Adaptive.rtol", self.rtol)
        check_positive("Adaptive.atol", self.atol)
        _check_options("Adaptive", self.options)
        for name, valid in (("loop", self.LOOPS), ("step_control", self.STEP_CONTROLS), ("controller", self.CONTROLLERS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"Adaptive.{name} must be one of {valid}, got {getattr(self, name)!r}")
        if self.progress is not None and not callable(self.progress):
            raise TypeError(f"Adaptive.progress must be a callable or None, got {type(self.progress).__name__}")
        if not isinstance(self.cuda_graph, bool):
            raise TypeError(f"Adaptive.cuda_graph must be a bool, got {type(self.cuda_graph).__name__}")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise TypeError(f"Adaptive.compile must be a bool or 'auto', got {self.compile!r}")
        if self.cuda_graph and self.compile is True:
            raise ValueError("Adaptive: cuda_graph=True and compile=True are two ways to capture the step: choose one")
        wanted = [
            f"{name}={value!r}"
            for name, value, default in (
                ("step_control", self.step_control, "shared"),
                ("controller", self.controller, "i"),
                ("progress", self.progress, None),
                ("cuda_graph", self.cuda_graph, False),
                ("compile", self.compile is True, False),  # ("auto": the native loop where et-ode's loop runs)
            )
            if value != default
        ]
        if self.loop == "torchdiffeq" and self.method not in ADAPTIVE_METHODS:
            wanted.append(f"method={self.method!r}")
        if self.loop == "torchdiffeq" and wanted:
            raise ValueError(f"Adaptive: {', '.join(wanted)} needs loop='et_ode' (or 'auto'), got loop='torchdiffeq'")
        if self.requires_own_loop and self.method not in self.OWN_METHODS:
            raise ValueError(
                f"Adaptive.method must be one of {self.OWN_METHODS} with et-ode's loop, got "
                f"{self.method!r} (use loop='torchdiffeq' for it)"
            )
        if self.requires_own_loop and set(self.options or {}) - {"first_step"}:
            raise ValueError(f"Adaptive.options of et-ode's loop may hold first_step only, got {sorted(self.options or {})}")

    @property
    def name(self) -> str:
        return self.method

    @property
    def requires_own_loop(self) -> bool:
        """Whether only et-ode's loop runs these settings (``loop="et_ode"``, or ``"auto"`` with a method or option
        only it has)."""
        return self.loop == "et_ode" or (
            self.loop == "auto"
            and (
                self.step_control != "shared"
                or self.controller != "i"
                or self.progress is not None
                or self.cuda_graph
                or self.compile is True
                or self.method not in ADAPTIVE_METHODS
            )
        )

    def own_loop(self, stop: object = None, save: str = "final", backward_method: str | None = None) -> bool:
        """Whether et-ode's loop integrates a solve with ``stop``, ``save`` and an adjoint's ``backward_method`` (None:
        the forward's): wherever the settings require it (:attr:`requires_own_loop`), and with ``loop="auto"`` for
        its methods (:attr:`OWN_METHODS`) wherever it runs the solve: ``options`` of ``first_step`` only, a stop with
        ``save="final"`` paired with the step control as :meth:`check_stop` says, a backward method of its own.
        torchdiffeq integrates the rest (``loop="torchdiffeq"`` always).

        Args:
            stop: the solve's stopping rule (a ``SteadyState``), or None.
            save: the solve's ``save`` option (``"all"``, ``"steps"`` or ``"final"``).
            backward_method: the adjoint's backward method, or None for the forward's (or no adjoint).

        Returns:
            True where et-ode's loop integrates the solve, False where torchdiffeq does.
        """
        if self.requires_own_loop:
            return True
        if self.loop != "auto" or self.method not in self.OWN_METHODS or set(self.options or {}) - {"first_step"}:
            return False
        if backward_method is not None and backward_method not in self.OWN_METHODS:
            return False
        return stop is None or (save == "final" and getattr(stop, "per_sample", None) == (self.step_control == "per_sample"))

    def check_stop(self, stop: object) -> None:
        """Any stopping rule works with torchdiffeq's loop. et-ode's loop stops each sample on its own with
        ``step_control="per_sample"`` and ``SteadyState(per_sample=True)``, the batch at once with shared control and
        ``per_sample=False`` (ValueError naming ``stop`` otherwise), where the test's crossing lies inside the step
        (located on the step's interpolant, refined with the field), its time differentiated under gradients.

        Args:
            stop: the solve's stopping rule (a ``SteadyState``), or None.

        Raises:
            ValueError: ``stop.per_sample`` does not match ``step_control`` where et-ode's loop runs the solve.
        """
        per_sample = getattr(stop, "per_sample", None)
        if stop is not None and self.requires_own_loop and per_sample != (self.step_control == "per_sample"):
            raise ValueError(
                f"stop=SteadyState(per_sample={per_sample}) with Adaptive(step_control="
                f"{self.step_control!r}): et-ode's loop stops each sample on its own with "
                f"step_control='per_sample' and per_sample=True, the whole batch with 'shared' and False"
            )

    def check_state(self, x0: Tensor) -> None:
        """``x0`` must not be half precision: step control's error estimate and step size underflow there (ValueError
        naming ``x0``, up front instead of an "underflow in dt" after the first step).

        Args:
            x0: the initial state ``(..., N, D)``.

        Raises:
            ValueError: ``x0`` is float16 or bfloat16.
        """
        if x0.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"x0 is {x0.dtype}, too coarse for the adaptive method {self.method!r}: its error estimate "
                f"and step size underflow. Use float32/float64 (x0.float() and model.float()), or a "
                f"fixed-step solver (EulerET(...), Fixed('rk4', step_size=...))"
            )

    def time_grid(self, t: Tensor | Sequence[float] | None, tau: float, device: torch.device, max_steps: int) -> Tensor:
        """The output times ``(T,)``, float64 (the step budget is checked while stepping).

        Args:
            t: the output times ``(T,)``, ``T >= 2``, finite and strictly increasing, or a pair ``(t0, t1)``.
            tau: the field's time constant (unused: the steps adapt).
            device: the device of the grid.
            max_steps: the step budget (checked while stepping).

        Returns:
            The grid ``(T,)``, float64, on ``device``.

        Raises:
            ValueError: ``t`` is None, not 1-D with at least 2 times, not finite or not strictly increasing.
            TypeError: ``t`` holds values that are not numbers.
        """
        return output_grid(t, device)

    def torchdiffeq_arguments(self, tau: float, stepping_to_event: bool) -> dict[str, Any]:
        """``method``, ``rtol``, ``atol`` and ``options`` for torchdiffeq.

        Args:
            tau: the field's time constant (unused).
            stepping_to_event: whether torchdiffeq's event loop runs the solve (unused).

        Returns:
            The keyword arguments of ``torchdiffeq.odeint``.
        """
        return dict(method=self.method, rtol=self.rtol, atol=self.atol, options=dict(self.options or {}))


@dataclass(frozen=True)
class Fixed:
    """A fixed-step torchdiffeq method.

    Args:
        method: one of :data:`FIXED_METHODS` (euler, midpoint, rk4, explicit_adams, implicit_adams).
        step_size: the step, positive; None steps on the output grid ``t`` itself (then no stopping rule: the event
            loop of fixed-step methods needs a step size).
        options: further torchdiffeq options (e.g. ``perturb``, ``interp``), or None.

    Raises:
        ValueError: an unknown ``method``, a ``step_size`` that is not positive, or ``options`` holding a step size.
    """

    method: FixedMethod = "rk4"
    step_size: float | None = None
    options: Mapping[str, Any] | None = None

    adaptive: ClassVar[bool] = False

    def __post_init__(self) -> None:
        name: str = self.method  # any value reaches here: the hints compare it with the other method sets
        if name not in FIXED_METHODS:
            raise ValueError(
                f"Fixed.method must be one of {FIXED_METHODS}, got {name!r}"
                + (" (an adaptive method: use Adaptive)" if name in ADAPTIVE_METHODS else "")
                + (" (the paper's scheme: use EulerET)" if name == "et" else "")
            )
        check_positive("Fixed.step_size", self.step_size, optional=True)
        _check_options("Fixed", self.options)
        if self.options and "step_size" in self.options:
            raise ValueError("Fixed.options must not hold step_size: give Fixed(step_size=...)")

    @property
    def name(self) -> str:
        return self.method

    def check_stop(self, stop: object) -> None:
        """A stopping rule needs a ``step_size``.

        Args:
            stop: the solve's stopping rule, or None.

        Raises:
            ValueError: a ``stop`` without a ``step_size``.
        """
        if stop is not None and self.step_size is None:
            raise ValueError(
                f"a stop with the fixed-step method {self.method!r} needs Fixed(step_size=...): "
                "torchdiffeq's fixed-step event loop steps by a step size, not on the grid t"
            )

    def check_state(self, x0: Tensor) -> None:
        """Every floating-point state works (fixed steps need no error estimate).

        Args:
            x0: the initial state ``(..., N, D)``.
        """

    def time_grid(self, t: Tensor | Sequence[float] | None, tau: float, device: torch.device, max_steps: int) -> Tensor:
        """The output times ``(T,)``, float64; :class:`SolverFailure` if the steps they take exceed ``max_steps``;
        ValueError naming ``t`` if its span is below the float64 resolution of ``step_size`` (no step to take) or its
        times so far from 0 that a step does not move them (:func:`check_steps_move`).

        Args:
            t: the output times ``(T,)``, ``T >= 2``, finite and strictly increasing, or a pair ``(t0, t1)``.
            tau: the field's time constant (unused: ``step_size`` is in units of time).
            device: the device of the grid.
            max_steps: the step budget.

        Returns:
            The grid ``(T,)``, float64, on ``device``.

        Raises:
            SolverFailure: the planned steps exceed ``max_steps``.
            ValueError: ``t`` is invalid (see :func:`output_grid`), spans less than the float64 resolution of
                ``step_size``, or lies where a step does not move the time.
            TypeError: ``t`` holds values that are not numbers.
        """
        grid = output_grid(t, device)
        if self.step_size is not None and float((grid[-1] - grid[0]) / self.step_size) + 1.0 == 1.0:
            raise ValueError(
                f"t spans {float(grid[-1] - grid[0]):.3g}, below the float64 resolution of "
                f"step_size={self.step_size}: its step grid would hold no step; lengthen t or "
                f"shorten step_size"
            )
        planned = len(grid) - 1 if self.step_size is None else int(torch.ceil((grid[-1] - grid[0]) / self.step_size))
        if planned > max_steps:
            raise SolverFailure(
                f"{planned} fixed steps planned from t={float(grid[0]):.6g} to {float(grid[-1]):.6g}, "
                f"more than max_steps={max_steps}",
                float(grid[0]),
                BUDGET_ADVICE,
            )
        if self.step_size is not None:
            check_steps_move(step_grid(grid, self.step_size), self.step_size)
        return grid

    def torchdiffeq_arguments(self, tau: float, stepping_to_event: bool) -> dict[str, Any]:
        """``method``, the corrector tolerances of ``implicit_adams`` and ``options`` (with ``step_size``) for torchdiffeq;
        the arguments are unused, as in :meth:`Adaptive.torchdiffeq_arguments`."""
        options = dict(self.options or {})
        if self.step_size is not None:
            options["step_size"] = float(self.step_size)
        return dict(method=self.method, rtol=CORRECTOR_RTOL, atol=CORRECTOR_ATOL, options=options)


@dataclass(frozen=True)
class EulerET:
    """The paper's scheme: ``steps`` updates ``x <- x - alpha dE/dg``, i.e. Euler steps of size ``alpha * tau``.

    Args:
        alpha: the step in units of ``tau``, positive (the paper: 0.1).
        steps: the number of steps, a positive integer (the paper: 12); the horizon is ``steps * alpha * tau``.

    The time grid is built here: give ``solve`` ``t=None`` (start at 0) or ``t=(t0,)``.

    Raises:
        ValueError: ``alpha`` is not positive and finite, or ``steps`` not a positive integer.
    """

    alpha: float = 0.1
    steps: int = 12

    adaptive: ClassVar[bool] = False
    method: ClassVar[str] = "euler"  # the torchdiffeq method it is

    def __post_init__(self) -> None:
        check_positive("EulerET.alpha", self.alpha)
        check_positive("EulerET.steps", self.steps, integer=True)

    @property
    def name(self) -> str:
        return "et"

    def check_stop(self, stop: object) -> None:
        """Every stopping rule works (steps of ``alpha * tau`` until the stop or the last step).

        Args:
            stop: the solve's stopping rule, or None.
        """

    def check_state(self, x0: Tensor) -> None:
        """Every floating-point state works.

        Args:
            x0: the initial state ``(..., N, D)``.
        """

    def time_grid(self, t: Tensor | Sequence[float] | None, tau: float, device: torch.device, max_steps: int) -> Tensor:
        """``t0 + k alpha tau`` for ``k = 0 .. steps``, float64; ``t`` must be None or ``(t0,)`` with a finite ``t0``
        (anything else, an end time included, is a ValueError naming ``t``); :class:`SolverFailure` before anything is
        built if ``steps`` exceeds ``max_steps``; ValueError naming ``t`` for a ``t0`` so far from 0 that a step does not
        move the time (:func:`check_steps_move`).

        Args:
            t: None (start at 0) or ``(t0,)``.
            tau: the field's time constant; a step is ``alpha * tau``.
            device: the device of the grid.
            max_steps: the step budget.

        Returns:
            The grid ``(steps + 1,)``, float64, on ``device``.

        Raises:
            SolverFailure: ``steps`` exceeds ``max_steps``.
            ValueError: ``t`` is neither None nor ``(t0,)`` with a finite real ``t0``, or ``t0`` lies where a step does
                not move the time.
        """
        t0 = _euler_start(t)
        if self.steps > max_steps:
            raise SolverFailure(
                f"steps={self.steps} is more than max_steps={max_steps}", t0, "raise max_steps or take fewer, larger steps"
            )
        grid = t0 + torch.arange(self.steps + 1, dtype=torch.float64) * (self.alpha * tau)
        check_steps_move(grid, self.alpha * tau)
        return grid.to(device)

    def torchdiffeq_arguments(self, tau: float, stepping_to_event: bool) -> dict[str, Any]:
        """Without a stop the steps are the grid itself; the event loop of a stop needs the step size.

        Args:
            tau: the field's time constant; a step is ``alpha * tau``.
            stepping_to_event: whether torchdiffeq's event loop runs the solve (then ``step_size`` is set).

        Returns:
            The keyword arguments of ``torchdiffeq.odeint`` (method ``"euler"``).
        """
        options = dict(step_size=self.alpha * tau) if stepping_to_event else {}
        return dict(method="euler", rtol=CORRECTOR_RTOL, atol=CORRECTOR_ATOL, options=options)


def check_steps_move(times: Tensor, step: float) -> None:
    """Every step of the float64 step times ``times`` ``(S + 1,)`` but a last one (torchdiffeq's grid may end in a
    step of zero) moves the time: ValueError naming ``t`` where the times lie so far from 0 that a ``step`` does not."""
    if not bool((times[1:-1] > times[:-2]).all()):
        raise ValueError(
            f"t reaches {float(times.abs().max()):.6g}, where a step of {step:g} does not move the time in float64: "
            f"start t nearer 0 (the field does not depend on time), or take larger steps"
        )


def _euler_start(t: object) -> float:
    """The start time of an :class:`EulerET` grid: 0 for ``t=None``, ``t0`` for ``t=(t0,)`` (a finite real number);
    ValueError naming ``t`` for anything else (an end time, a grid, a tensor)."""
    if t is None:
        return 0.0
    if not isinstance(t, (tuple, list)) or len(t) != 1:
        raise ValueError(
            f"EulerET builds its grid from alpha and steps (horizon steps * alpha * tau); give t=None or "
            f"t=(t0,), got t={t!r}; for an end time use Fixed('euler', step_size=...) with t=(t0, t1)"
        )
    (start,) = t
    if isinstance(start, bool) or not isinstance(start, (int, float)) or not math.isfinite(start):
        raise ValueError(f"t=(t0,) needs a finite real t0 with EulerET, got t={t!r}")
    return float(start)


Solver = Adaptive | Fixed | EulerET


def as_solver(solver: Solver | str) -> Solver:
    """A solver object from itself or a method's name (``"dopri5"`` -> ``Adaptive("dopri5")``, ``"rk4"`` ->
    ``Fixed("rk4")`` stepping on the grid, ``"et"`` -> ``EulerET()``); ValueError listing the valid names."""
    if isinstance(solver, (Adaptive, Fixed, EulerET)):
        return solver
    if solver in ADAPTIVE_METHODS:
        return Adaptive(solver)
    if solver in FIXED_METHODS:
        return Fixed(solver)
    if solver == "et":
        return EulerET()
    raise ValueError(
        f"solver must be Adaptive(...), Fixed(...), EulerET(...) or a method name; valid methods: "
        f"{', '.join(METHODS)}; got {solver!r}"
    )
