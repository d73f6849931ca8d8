"""How a model runs its ET block: an :class:`Integration` (the settings of :func:`et_ode.solve` with a horizon) or an
:class:`~et_ode.AttractorReadout`, and both as plain data.

An :class:`Integration` holds the :class:`~et_ode.Adaptive` / :class:`~et_ode.Fixed` / :class:`~et_ode.EulerET` solver,
the :class:`~et_ode.Direct` / :class:`~et_ode.Adjoint` / :class:`~et_ode.Implicit` gradient and the
:class:`~et_ode.SteadyState` stop that ``solve`` takes, plus the horizon ``t1`` and the step budget. A model's
:data:`Dynamics` is one or the other; each gives the model its answer with ``answer(field, x0)``.
:func:`settings_to_dict` and :func:`settings_from_dict` write and read any of these objects as plain data (for
checkpoints and JSON reports).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from et_ode.backend.validation import check_positive
from et_ode.dynamics.field import ETField
from et_ode.equilibrium.attractor import AttractorReadout
from et_ode.integrators.solution import Save, Solution
from et_ode.integrators.solvers import ADAPTIVE_METHODS, FIXED_METHODS, Adaptive, EulerET, Fixed, Method, Solver, as_solver
from et_ode.integrators.stopping import SteadyState
from et_ode.solving.gradients import Adjoint, Direct, Gradient, GradientName, Implicit, as_gradient
from et_ode.solving.solve import solve

T = TypeVar("T")
_KINDS: dict[str, type] = {
    kind.__name__: kind for kind in (Adaptive, Fixed, EulerET, Direct, Adjoint, Implicit, SteadyState, AttractorReadout)
}


def settings_to_dict(settings: Any) -> dict[str, Any]:
    """A settings object (a solver, gradient strategy, stop, attractor readout or integration) as plain data:
    ``{"kind": class name, **fields}``, a field that is itself a settings object nested the same way."""
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return {
        "kind": type(settings).__name__,
        **{
            name: settings_to_dict(value) if isinstance(value, tuple(_KINDS.values())) else value
            for name, value in fields.items()
        },
    }


def settings_from_dict(data: Mapping[str, Any]) -> Any:
    """The settings object that :func:`settings_to_dict` wrote (ValueError naming an unknown ``kind``)."""
    fields = dict(data)
    kind = fields.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"settings kind must be one of {tuple(_KINDS)}, got {kind!r}")
    nested = {
        name: settings_from_dict(value) for name, value in fields.items() if isinstance(value, Mapping) and "kind" in value
    }
    return _KINDS[kind](**{**fields, **nested})


def _named(options: str, make: Callable[[], T]) -> T:
    """``make()``, its ValueError or TypeError prefixed with the flat ``options`` it is built from (the names a
    command line or a grid search knows)."""
    try:
        return make()
    except (ValueError, TypeError) as error:
        raise type(error)(f"{options}: {error}") from None


@dataclass(frozen=True)
class Integration:
    """The arguments of :func:`et_ode.solve` that a model fixes, and its horizon.

    Args:
        solver: a solver object or a method's name (:func:`et_ode.integrators.solvers.as_solver`).
        gradient: a gradient strategy or its name (:func:`et_ode.solving.gradients.as_gradient`).
        stop: a :class:`~et_ode.SteadyState` (``t1`` is then the longest time allowed), or None.
        t1: the horizon, from 0, positive and finite; :class:`~et_ode.EulerET` ignores it (its horizon is
            ``steps * alpha * tau``).
        max_steps: the solver's step budget.

    Raises:
        ValueError: an unknown solver or gradient name, ``t1`` or ``max_steps`` not positive, or settings that do not
            go together (the rules of the gradient strategy and the solver, e.g. ``Implicit`` without a stop).
        TypeError: ``stop`` is not a SteadyState or None.
    """

    solver: Solver = Adaptive()  # a method's name is accepted too (as_solver)
    gradient: Gradient = Direct()  # a strategy's name is accepted too (as_gradient)
    stop: SteadyState | None = None
    t1: float = 1.0
    max_steps: int = 10_000

    def __post_init__(self) -> None:
        solver, gradient = as_solver(self.solver), as_gradient(self.gradient)
        object.__setattr__(self, "solver", solver)  # a name becomes its object: fields hold objects only
        object.__setattr__(self, "gradient", gradient)
        if self.stop is not None and not isinstance(self.stop, SteadyState):
            raise TypeError(f"Integration.stop must be an et_ode.SteadyState or None, got {type(self.stop).__name__}")
        check_positive("Integration.t1", self.t1)
        check_positive("Integration.max_steps", self.max_steps, integer=True)
        gradient.check(self.stop)
        solver.check_stop(self.stop)

    @classmethod
    def from_options(
        cls,
        solver: Method = "dopri5",
        *,
        t1: float = 1.0,
        rtol: float = 1e-5,
        atol: float = 1e-6,
        step: float | None = None,
        steps: int | None = None,
        gradient: GradientName = "direct",
        adjoint_rtol: float | None = None,
        adjoint_atol: float | None = None,
        seminorm: bool = False,
        steady_state: float | None = None,
        max_steps: int = 10_000,
    ) -> Integration:
        """The settings objects from flat options, as a command line or a grid search gives them.

        Args:
            solver: a method's name (:data:`~et_ode.integrators.solvers.METHODS`).
            t1: the end time, as in :class:`Integration`.
            rtol, atol: an adaptive method's tolerances (ignored by the others).
            step: a fixed method's step size (None: on the grid) or the alpha of ``"et"``.
            steps: the number of steps of ``"et"`` (``step`` and ``steps`` default to :class:`~et_ode.EulerET`'s).
            gradient: ``"direct"``, ``"adjoint"`` or ``"implicit"``.
            adjoint_rtol, adjoint_atol, seminorm: the adjoint's backward solve (:class:`~et_ode.Adjoint`).
            steady_state: the tolerance of a :class:`~et_ode.SteadyState` stop (None: none).
            max_steps: the step budget, as in :class:`Integration`.

        Returns:
            The :class:`Integration`.

        Raises:
            ValueError: an unknown ``solver`` or ``gradient``, a ``step`` for an adaptive method, or a bad setting
                (the message starts with the flat options it came from).
        """
        solver_object: Solver
        if solver in ADAPTIVE_METHODS:
            if step is not None:
                raise ValueError(f"step is for fixed-step methods; {solver!r} is adaptive (use rtol/atol)")
            solver_object = _named(f"solver={solver!r} with rtol={rtol}, atol={atol}", lambda: Adaptive(solver, rtol, atol))
        elif solver == "et":
            alpha = EulerET.alpha if step is None else step  # (the class attributes are the defaults)
            count = EulerET.steps if steps is None else steps
            solver_object = _named(f"solver='et' with step={step}, steps={steps}", lambda: EulerET(alpha, count))
        elif solver in FIXED_METHODS:
            solver_object = _named(f"solver={solver!r} with step={step}", lambda: Fixed(solver, step))
        else:
            solver_object = as_solver(solver)  # ValueError listing the methods
        gradient_object: Gradient = (
            as_gradient(gradient)
            if gradient != "adjoint"
            else _named(
                f"gradient='adjoint' with adjoint_rtol={adjoint_rtol}, adjoint_atol={adjoint_atol}",
                lambda: Adjoint(adjoint_rtol, adjoint_atol, seminorm=seminorm),
            )
        )
        stop = None if steady_state is None else _named(f"steady_state={steady_state}", lambda: SteadyState(steady_state))
        return _named(
            f"gradient={gradient!r}, steady_state={steady_state}, t1={t1}, max_steps={max_steps}",
            lambda: cls(
                solver=solver_object,
                gradient=gradient_object,
                stop=stop,
                t1=t1,
                max_steps=max_steps,
            ),
        )

    def replace(self, **changes: Any) -> Integration:
        """A copy with ``changes`` (field names: ``solver``, ``gradient``, ``stop``, ``t1``, ``max_steps``) applied.

        Args:
            **changes: the fields to change and their values.

        Returns:
            The changed :class:`Integration` (validated as a new one).
        """
        return dataclasses.replace(self, **changes)

    def solve(self, field: ETField, x0: Tensor, t: Tensor | Sequence[float] | None = None, save: Save = "all") -> Solution:
        """:func:`et_ode.solve` with these settings.

        Args:
            field: the vector field.
            x0: initial states ``(*batch, N, D)``.
            t: the output times ``(T,)`` (default ``(0, t1)``; :class:`~et_ode.EulerET` builds its own grid from
                ``t=None``).
            save: what to save, as in :func:`et_ode.solve` (default ``"all"``: the states at the times ``t``).

        Returns:
            The :class:`~et_ode.Solution`.
        """
        if t is None and not isinstance(self.solver, EulerET):
            t = (0.0, self.t1)
        return solve(
            field, x0, t, solver=self.solver, gradient=self.gradient, stop=self.stop, save=save, max_steps=self.max_steps
        )

    def answer(self, field: ETField, x0: Tensor) -> Solution:
        """The solution a model reads its answer from: the end of the integration to ``t1`` (``save="final"``).

        Args:
            field: the vector field.
            x0: initial states ``(*batch, N, D)``.

        Returns:
            The :class:`~et_ode.Solution`; its ``x`` is ``(*batch, N, D)``.
        """
        return self.solve(field, x0, save="final")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): :func:`settings_to_dict`."""
        return settings_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Integration:
        """The inverse of :meth:`to_dict`.

        Args:
            data: what :meth:`to_dict` wrote.

        Returns:
            The :class:`Integration`.

        Raises:
            ValueError: ``data`` describes another kind of settings.
        """
        integration = settings_from_dict(data)
        if not isinstance(integration, Integration):
            raise ValueError(f"an integration's data must have kind 'Integration', got {data.get('kind')!r}")
        return integration


_KINDS[Integration.__name__] = Integration
#: how a model runs its ET block: an integration to a horizon or the certified attractor of the flow
Dynamics = Integration | AttractorReadout


def check_dynamics(name: str, dynamics: object) -> Dynamics:
    """``dynamics`` itself when it is an :class:`Integration` or an :class:`~et_ode.AttractorReadout` (TypeError
    naming ``name`` otherwise)."""
    if not isinstance(dynamics, (Integration, AttractorReadout)):
        raise TypeError(f"{name} must be an et_ode.Integration or an et_ode.AttractorReadout, got {type(dynamics).__name__}")
    return dynamics
