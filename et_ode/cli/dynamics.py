"""The dynamics options shared by the subcommands (``--solver``, ``--t1``, ``--rtol``, ``--atol``, ``--step``,
``--steps``, ``--gradient``, ``--adjoint-rtol``, ``--adjoint-atol``, ``--seminorm``, ``--steady-state``,
``--max-steps``), and the one function that turns them into the settings objects of :func:`et_ode.solve`
(:meth:`et_ode.Integration.from_options`)."""

from __future__ import annotations

import argparse

from et_ode.integrators.solvers import METHODS, Adaptive, EulerET, Fixed, as_solver
from et_ode.solving.gradients import GRADIENTS, Adjoint, as_gradient
from et_ode.solving.integration import Integration

#: every dynamics option; a subcommand adds those it offers
OPTIONS = (
    "solver",
    "t1",
    "rtol",
    "atol",
    "step",
    "steps",
    "gradient",
    "adjoint_rtol",
    "adjoint_atol",
    "seminorm",
    "steady_state",
    "max_steps",
)


def add_dynamics_arguments(
    parser: argparse.ArgumentParser, defaults: Integration, options: tuple[str, ...] = OPTIONS
) -> None:
    """Add the dynamics ``options`` to ``parser``, their defaults read from ``defaults``."""
    solver, gradient = as_solver(defaults.solver), as_gradient(defaults.gradient)  # objects already: typed as such
    rtol = solver.rtol if isinstance(solver, Adaptive) else Adaptive().rtol
    atol = solver.atol if isinstance(solver, Adaptive) else Adaptive().atol
    step = solver.alpha if isinstance(solver, EulerET) else solver.step_size if isinstance(solver, Fixed) else None
    adjoint = gradient if isinstance(gradient, Adjoint) else Adjoint()
    group = parser.add_argument_group("dynamics (how the ET block is integrated: et_ode.Integration)")
    arguments = {
        "solver": dict(
            default=solver.name,
            choices=METHODS,
            help="ODE method (Adaptive: dopri5 ...; Fixed: euler, rk4 ...); 'et' is the paper's scheme "
            "EulerET (--step alpha, --steps n)",
        ),
        "t1": dict(type=float, default=defaults.t1, help="time horizon from 0 (EulerET: steps * alpha * tau)"),
        "rtol": dict(type=float, default=rtol, help="rtol of an adaptive method"),
        "atol": dict(type=float, default=atol, help="atol of an adaptive method"),
        "step": dict(type=float, default=step, help="step size of a fixed method (none: on the saved times), alpha of 'et'"),
        "steps": dict(
            type=int, default=solver.steps if isinstance(solver, EulerET) else None, help="number of steps of 'et'"
        ),
        "gradient": dict(
            default=type(gradient).__name__.lower(),
            choices=GRADIENTS,
            help="how gradients pass through the solve ('implicit' needs --steady-state)",
        ),
        "adjoint_rtol": dict(
            type=float, default=adjoint.rtol, help="rtol of the adjoint's backward solve (default: --rtol)"
        ),
        "adjoint_atol": dict(
            type=float, default=adjoint.atol, help="atol of the adjoint's backward solve (default: --atol)"
        ),
        "seminorm": dict(
            action=argparse.BooleanOptionalAction,
            default=adjoint.seminorm,
            help="adjoint step control on the state channels only (a cheaper backward solve)",
        ),
        "steady_state": dict(
            type=float,
            default=None if defaults.stop is None else defaults.stop.tol,
            metavar="TOL",
            help="stop at the attractor: RMS |dg/dt| < TOL (t1 is then the longest time)",
        ),
        "max_steps": dict(type=int, default=defaults.max_steps, help="solver step limit"),
    }
    for name in options:
        group.add_argument("--" + name.replace("_", "-"), **arguments[name])  # type: ignore[arg-type]


def integration_from(args: argparse.Namespace, defaults: Integration) -> Integration:
    """The :class:`~et_ode.Integration` the parsed options name (options a subcommand does not offer: ``defaults``'s
    horizon, step budget, gradient and stop)."""
    given = {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}
    given.setdefault("t1", defaults.t1)
    given.setdefault("max_steps", defaults.max_steps)
    integration = Integration.from_options(**given)
    if "gradient" not in given:
        integration = integration.replace(gradient=defaults.gradient)
    if "steady_state" not in given:
        integration = integration.replace(stop=defaults.stop)
    return integration
