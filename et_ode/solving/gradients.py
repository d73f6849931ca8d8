"""How :func:`et_ode.solve` differentiates: the three gradient strategies that ``gradient=`` takes, each running its
own integration.

- :class:`Direct`: backpropagate through the solver's operations (exact for the discrete solve; memory grows with
  the steps). Fixed steps without a stop run in :mod:`et_ode.integrators.fixed_step`'s lean loop.
- :class:`Adjoint`: the adjoint method, a backward ODE solve (memory independent of the steps) on et-ode's adaptive
  loop where it runs the forward solve, else torchdiffeq's, with its own tolerances, method and an optional seminorm.
- :class:`Implicit`: the implicit function theorem at the fixed point reached by a stop (memory and cost independent
  of the steps); the forward solve runs without gradients and its end is polished into the certified attractor of
  its flow (:func:`~et_ode.equilibrium.certify.certify`, the hand-off loop of :func:`et_ode.find_attractor`).
  Gradients flow through ``Solution.g`` only. It is defined in :mod:`et_ode.equilibrium.attractor`, beside
  ``find_attractor``, whose ``implicit=`` takes the same object; this module is where ``solve`` finds all three.

A plain string names each (:func:`as_gradient`). Each is a :class:`Strategy`: its ``check`` holds its rule with the
stopping rule (``Implicit`` needs one); its ``run`` first checks that the model's parameters are finite
(:func:`check_weights`: a ValueError naming the first that is not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from torchdiffeq import odeint, odeint_adjoint

from et_ode.backend.validation import check_positive
from et_ode.equilibrium.attractor import Implicit
from et_ode.integrators.loop import Integrated, Problem, integrate
from et_ode.integrators.solvers import ADAPTIVE_METHODS, FIXED_METHODS, AdaptiveMethod, FixedMethod
from et_ode.integrators.stopping import SteadyState

GradientName = Literal["direct", "adjoint", "implicit"]
GRADIENTS: tuple[GradientName, ...] = get_args(GradientName)


class Strategy(Protocol):
    """What :func:`et_ode.solve` asks of a gradient strategy (:class:`Direct`, :class:`Adjoint`,
    :class:`~et_ode.equilibrium.attractor.Implicit`): a rule with the stopping rule, and a run of the solve."""

    def check(self, stop: SteadyState | None) -> None:
        """Refuse a stopping rule the strategy cannot differentiate.

        Args:
            stop: the solve's stopping rule, or None.

        Raises:
            ValueError: the strategy needs another ``stop``.
        """

    def run(self, problem: Problem) -> Integrated:
        """Integrate ``problem`` after checking that the model's parameters are finite.

        Args:
            problem: the validated solve: ``x0`` ``(*batch, N, D)``, output grid ``(T,)``, solver, stop and budget.

        Returns:
            The saved times ``(T,)`` and states, the final ``x`` and ``g`` ``(*batch, N, D)``, stop times and status.

        Raises:
            ValueError: a parameter of the model is not finite.
            SolverFailure: the integration cannot go on (step budget exceeded, non-finite state).
        """


@dataclass(frozen=True)
class Direct(Strategy):
    """Backpropagate through the solver's operations: ``Solution.x`` and ``Solution.g`` are differentiable."""

    def check(self, stop: SteadyState | None) -> None:
        """Any stopping rule (gradients flow through the stopping time)."""

    def run(self, problem: Problem) -> Integrated:
        """Integrate ``problem`` with autograd recording the solver's operations."""
        problem.field.check_weights()
        return integrate(problem, odeint, problem.torchdiffeq_arguments(), lean=True)


@dataclass(frozen=True)
class Adjoint(Strategy):
    """The adjoint: the gradient by a backward ODE solve, memory independent of the steps; on et-ode's adaptive loop
    where it runs the forward solve (the backward per sample or shared as the forward, the parameters' channels out
    of step control whatever ``seminorm`` says), else torchdiffeq's ``odeint_adjoint``.

    Args:
        rtol, atol: the backward solve's tolerances (None: the forward solve's).
        method: the backward solve's torchdiffeq method (None: the forward's).
        seminorm: drop the parameter-gradient channels from the backward step-size control (a cheaper backward
            solve).

    The backward solve has a step budget of its own of ``max_steps``; beyond it :class:`et_ode.SolveError` comes out
    of ``loss.backward()``.

    Raises:
        ValueError: ``rtol`` or ``atol`` is not positive, or ``method`` is not a torchdiffeq method.
        TypeError: ``seminorm`` is not a bool.
    """

    rtol: float | None = None
    atol: float | None = None
    method: AdaptiveMethod | FixedMethod | None = None
    seminorm: bool = False

    def __post_init__(self) -> None:
        check_positive("Adjoint.rtol", self.rtol, optional=True)
        check_positive("Adjoint.atol", self.atol, optional=True)
        methods = (*ADAPTIVE_METHODS, *FIXED_METHODS)
        if self.method is not None and self.method not in methods:
            raise ValueError(f"Adjoint.method must be None or one of {methods}, got {self.method!r}")
        if not isinstance(self.seminorm, bool):
            raise TypeError(f"Adjoint.seminorm must be a bool, got {self.seminorm!r}")

    def check(self, stop: SteadyState | None) -> None:
        """Any stopping rule."""

    def run(self, problem: Problem) -> Integrated:
        """Integrate ``problem`` forward without storing the steps; the backward solve runs in ``loss.backward()``."""
        problem.field.check_weights()
        arguments = problem.torchdiffeq_arguments()
        arguments.update(
            adjoint_params=tuple(problem.field.parameters()),
            adjoint_rtol=self.rtol or arguments["rtol"],
            adjoint_atol=self.atol or arguments["atol"],
            adjoint_method=self.method,
            adjoint_options=dict(norm="seminorm") if self.seminorm else None,
        )
        return integrate(problem, odeint_adjoint, arguments)


Gradient = Direct | Adjoint | Implicit
_BY_NAME = {"direct": Direct, "adjoint": Adjoint, "implicit": Implicit}


def as_gradient(gradient: Gradient | str) -> Gradient:
    """A gradient strategy from itself or its name (``"direct"``, ``"adjoint"``, ``"implicit"``: default settings);
    ValueError naming ``gradient`` otherwise."""
    if isinstance(gradient, (Direct, Adjoint, Implicit)):
        return gradient
    if isinstance(gradient, str) and gradient in _BY_NAME:
        return _BY_NAME[gradient]()
    raise ValueError(f"gradient must be Direct(), Adjoint(...), Implicit(...) or one of {GRADIENTS}, got {gradient!r}")
