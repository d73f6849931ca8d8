"""How :func:`et_ode.solve` differentiates: three gradient strategies, each running its own integration.

- :class:`Direct`: backpropagate through the solver's operations (exact for the discrete solve; memory grows with
  the steps). Fixed steps without a stop run in :mod:`et_ode.fixed_step`'s lean loop.
- :class:`Adjoint`: torchdiffeq's adjoint method, a backward ODE solve (memory independent of the steps), with its
  own tolerances, method and an optional seminorm.
- :class:`Implicit`: the implicit function theorem at the fixed point reached by a stop (memory and cost independent
  of the steps); the forward solve runs without gradients and its end is polished into the certified attractor of
  its flow (:func:`et_ode.certify.certify`, the hand-off loop of :func:`et_ode.find_attractor`). Gradients flow through
  ``Solution.g`` only.

A plain string names each (:func:`as_gradient`): ``"direct"``, ``"adjoint"``, ``"implicit"``. A strategy's
:meth:`check` holds its rule with the stopping rule (``Implicit`` needs one). Each strategy first checks that the
model's parameters are finite (:func:`check_weights`: a ValueError naming the first that is not).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torchdiffeq import odeint, odeint_adjoint

from ._loop import Integrated, Problem, integrate
from .certify import certify, default_tol
from .field import ETField
from .gradients import default_implicit_tol
from .solution import SolveError, Status
from .solvers import ADAPTIVE_METHODS, FIXED_METHODS
from .stopping import SteadyState

GRADIENTS = ("direct", "adjoint", "implicit")


def check_weights(field: ETField) -> None:
    """Every floating-point parameter of the field's model is finite: a ValueError naming the first that holds NaN or
    infinite values (the dynamics are then undefined, and a solve would fail far from the cause)."""
    named = [(name, p) for name, p in field.model.named_parameters() if p.is_floating_point() and p.numel()]
    with torch.no_grad():
        finite = torch.stack([torch.isfinite(p).all() for _, p in named]) if named else None
    if finite is None or bool(finite.all()):  # one synchronisation for all the parameters
        return
    name = named[int((~finite).nonzero()[0])][0]
    raise ValueError(f"the model's parameter {name!r} holds NaN or infinite values, so the dynamics are "
                     f"undefined; reload the weights (a diverged training step?)")


def _optional_positive(owner: str, name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not (0 < value < math.inf)):
        raise ValueError(f"{owner}.{name} must be a positive finite number or None, got {value!r}")


@dataclass(frozen=True)
class Direct:
    """Backpropagate through the solver's operations: ``Solution.x`` and ``Solution.g`` are differentiable."""

    def check(self, stop: SteadyState | None) -> None:
        """Any stopping rule (gradients flow through the stopping time)."""

    def run(self, problem: Problem) -> Integrated:
        check_weights(problem.field)
        return integrate(problem, odeint, problem.torchdiffeq_arguments(), lean=True)


@dataclass(frozen=True)
class Adjoint:
    """torchdiffeq's adjoint: the gradient by a backward ODE solve, memory independent of the steps.

    Args:
        rtol, atol: the backward solve's tolerances (None: the forward solve's).
        method: the backward solve's torchdiffeq method (None: the forward's).
        seminorm: drop the parameter-gradient channels from the backward step-size control (often halves its cost).

    The backward solve has a step budget of its own of ``max_steps``; beyond it :class:`et_ode.SolveError` comes out
    of ``loss.backward()``.
    """

    rtol: float | None = None
    atol: float | None = None
    method: str | None = None
    seminorm: bool = False

    def __post_init__(self) -> None:
        _optional_positive("Adjoint", "rtol", self.rtol)
        _optional_positive("Adjoint", "atol", self.atol)
        methods = (*ADAPTIVE_METHODS, *FIXED_METHODS)
        if self.method is not None and self.method not in methods:
            raise ValueError(f"Adjoint.method must be None or one of {methods}, got {self.method!r}")
        if not isinstance(self.seminorm, bool):
            raise TypeError(f"Adjoint.seminorm must be a bool, got {self.seminorm!r}")

    def check(self, stop: SteadyState | None) -> None:
        """Any stopping rule."""

    def run(self, problem: Problem) -> Integrated:
        check_weights(problem.field)
        arguments = problem.torchdiffeq_arguments()
        arguments.update(adjoint_params=tuple(problem.field.parameters()),
                         adjoint_rtol=self.rtol or arguments["rtol"], adjoint_atol=self.atol or arguments["atol"],
                         adjoint_method=self.method, adjoint_options=dict(norm="seminorm") if self.seminorm else None)
        return integrate(problem, odeint_adjoint, arguments)


@dataclass(frozen=True)
class Implicit:
    """The implicit function theorem at the fixed point a stop reaches (:mod:`et_ode.gradients`).

    Args:
        tol: relative residual of the conjugate-gradient solve of the adjoint system, positive; None (the default):
            :func:`~et_ode.gradients.default_implicit_tol` of the state's dtype, 1e-8 in float64 and 1e-3 in float32
            (the rounding of float32 Hessian-vector products stalls the solve near 1e-6 to 1e-4).
        max_iter: its iteration cap, a positive integer.
    """

    tol: float | None = None
    max_iter: int = 200

    def __post_init__(self) -> None:
        _optional_positive("Implicit", "tol", self.tol)
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int) or self.max_iter < 1:
            raise ValueError(f"Implicit.max_iter must be a positive integer, got {self.max_iter!r}")

    def check(self, stop: SteadyState | None) -> None:
        """A stopping rule is needed: the gradient is defined at a fixed point (ValueError naming ``stop``)."""
        if stop is None:
            raise ValueError("gradient=Implicit() differentiates at a fixed point: give stop=SteadyState(tol)")

    def run(self, problem: Problem) -> Integrated:
        check_weights(problem.field)
        with torch.no_grad():
            result = integrate(problem, odeint, problem.torchdiffeq_arguments())
        t_final = float(result.ts[-1])
        if result.status is not Status.STEADY_STATE:
            tested = problem.stop.description if problem.stop is not None else "a stop"
            raise SolveError(f"gradient=Implicit() needs a converged fixed point, but the solve reached t={t_final:.6g} "
                             f"without {tested}; integrate longer or loosen the stop's tol", time=t_final, solution=None)
        # polish the end state into the flow's certified attractor (flowing on where its basin is not yet settled),
        # and differentiate there (exactly)
        x_end = result.x.detach()
        implicit_tol = default_implicit_tol(x_end.dtype) if self.tol is None else self.tol
        attractor = certify(problem.field, x_end, tol=default_tol(x_end.dtype), flow=True, implicit_tol=implicit_tol,
                            implicit_max_iter=self.max_iter)
        if not bool(attractor.certified.all()):
            raise SolveError(
                f"gradient=Implicit(): the end state did not polish into a certified stable attractor of its flow "
                f"(statuses {attractor.status}, RMS gradient {attractor.gradient.flatten().tolist()}); the implicit "
                "gradient is defined only there", time=t_final, solution=None)
        xs = None if result.xs is None else torch.cat([result.xs[:-1], attractor.x.detach()[None]])
        return dataclasses.replace(result, xs=xs, x=attractor.x, g=attractor.g)


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
