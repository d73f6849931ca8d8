"""The attractor a flow ends in, found fast and certified: ``find_attractor``.

The ET's flow ``tau dx/dt = -dE/dg`` reaches its answer only as a power law in ``t``: ``x`` drifts outward, each
token's ``g_A - delta`` tends to the sphere of radius ``gamma sqrt(D)``, and ``g`` tends to a critical point of
``E`` on the product of those spheres (:mod:`et_ode.dynamics.manifold`). ``find_attractor`` gets there in a loop of three
phases, per sample:

1. **Flow** to a hand-off level: dopri5 until RMS ``|T dE/dg| <= level``, with a common rescaling of each sample
   between segments (same path of ``g``, undone slow-down).
2. **Newton** from there: trust-region Riemannian Newton (never climbing to a saddle), in the geometry the outward
   forces ``rho_A = -s_A . dE/dg_A`` choose: on the spheres when every token pushes outward, in ``x`` (a fixed
   point at finite scale, ``geometry="x"``) when one does not; ``"mixed"`` when neither holds.
3. **Certificate and basin test**: the residual, the Hessian's smallest eigenvalue (Lanczos) and kind, and the
   linear-regime test (:func:`et_ode.equilibrium.certify.basin_settled`), which ties the Newton point to the flow from the
   hand-off point. A sample that is not certified flows on to a level ten times lower and is examined again; one
   whose Newton point is converged and stable but not yet tied to the flow is tested against it between the flow's
   segments, and certified there as soon as the flow is in its basin.
A sample still not certified after the last level keeps its status (``"unsettled"``, ``"saddle"``, ...):
``find_attractor`` never reports another point as the flow's own. On the spheres the returned ``x`` has every token
centred at a scale ``S`` where ``eps / S^2`` is below rounding, so ``g`` lies on the limit spheres (rescale first).

``Attractor.g`` is differentiable with respect to the model's parameters by the implicit function theorem at
certified points (:func:`et_ode.equilibrium.implicit.implicit_attractor`); other samples refuse (:class:`AttractorError`).
``x0`` gets no gradient. Shapes: ``x0`` is ``(*batch, N, D)``; per-sample results are ``(*batch,)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from torchdiffeq import odeint

from et_ode.backend.memory import memory_named
from et_ode.backend.validation import check_positive
from et_ode.dynamics.field import ETField
from et_ode.energy.checks import check_mask, check_tokens
from et_ode.equilibrium.certify import (
    FLOW_ATOL,
    FLOW_RTOL,
    HANDOFF,
    HANDOFFS,
    MAX_SEGMENTS,
    SEARCH_METHODS,
    SEGMENT,
    Attractor,
    FlowPhase,
    SearchMethod,
    certify,
    check_lyapunov_neuron,
    default_tol,
    differentiable,
    flatten,
    settle,
)
from et_ode.equilibrium.implicit import AttractorError, default_implicit_tol
from et_ode.integrators.loop import Integrated, Problem, integrate
from et_ode.integrators.solution import Solution, SolveError, SolveStats, Status
from et_ode.integrators.stopping import SteadyState

__all__ = ["Attractor", "AttractorError", "AttractorReadout", "default_tol", "find_attractor"]
MEMORY_ADVICE = "search fewer samples at a time, or use another device"


# -- the public entry point ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Implicit:
    """The implicit function theorem at the fixed point a stop reaches (:mod:`et_ode.equilibrium.implicit`).

    Args:
        tol: relative residual of the conjugate-gradient solve of the adjoint system, positive; None (the default):
            :func:`~et_ode.equilibrium.implicit.default_implicit_tol` of the state's dtype,
            1e-8 in float64 and 1e-3 in float32
            (the rounding of float32 Hessian-vector products stalls the solve near 1e-6 to 1e-4).
        max_iter: its iteration cap, a positive integer.

    Raises:
        ValueError: ``tol`` or ``max_iter`` is not positive (named); at :func:`et_ode.solve`, a solve without a stop.
    """

    tol: float | None = None
    max_iter: int = 200

    def __post_init__(self) -> None:
        check_positive("Implicit.tol", self.tol, optional=True)
        check_positive("Implicit.max_iter", self.max_iter, integer=True)

    def check(self, stop: SteadyState | None) -> None:
        """A stopping rule is needed: the gradient is defined at a fixed point.

        Args:
            stop: the solve's stopping rule, or None.

        Raises:
            ValueError: ``stop`` is None.
        """
        if stop is None:
            raise ValueError("gradient=Implicit() differentiates at a fixed point: give stop=SteadyState(tol)")

    def run(self, problem: Problem) -> Integrated:
        """Integrate ``problem`` without gradients to its stop, then polish the end into the certified attractor of
        its flow; gradients flow through the returned ``g`` by the implicit function theorem.

        Args:
            problem: the validated solve: ``x0`` ``(*batch, N, D)``, output grid ``(T,)``, solver, stop and budget.

        Returns:
            The saved times ``(T,)`` and states, the attractor's ``x`` and ``g`` ``(*batch, N, D)``, stop times and
            status.

        Raises:
            ValueError: a parameter of the model is not finite.
            SolverFailure: the integration cannot go on (step budget exceeded, non-finite state).
            SolveError: the solve ends without reaching its stop, or the end state does not polish into a certified
                stable attractor.
        """
        problem.field.check_weights()
        with torch.no_grad():
            result = integrate(problem, odeint, problem.torchdiffeq_arguments())
        t_final = float(result.ts[-1])
        if result.status is not Status.STEADY_STATE:
            tested = problem.stop.description if problem.stop is not None else "a stop"
            raise SolveError(
                f"gradient=Implicit() needs a converged fixed point, but the solve reached t={t_final:.6g} "
                f"without {tested}; integrate longer or loosen the stop's tol",
                time=t_final,
                solution=None,
            )
        # polish the end state into the flow's certified attractor (flowing on where its basin is not yet settled),
        # and differentiate there (exactly)
        x_end = result.x.detach()
        implicit_tol = default_implicit_tol(x_end.dtype) if self.tol is None else self.tol
        attractor = certify(
            problem.field,
            x_end,
            tol=default_tol(x_end.dtype),
            flow=True,
            implicit_tol=implicit_tol,
            implicit_max_iter=self.max_iter,
        )
        if not bool(attractor.certified.all()):
            raise SolveError(
                f"gradient=Implicit(): the end state did not polish into a certified stable attractor of its flow "
                f"(statuses {attractor.status}, RMS gradient {attractor.gradient.flatten().tolist()}); the implicit "
                "gradient is defined only there",
                time=t_final,
                solution=None,
            )
        xs = None if result.xs is None else torch.cat([result.xs[:-1], attractor.x.detach()[None]])
        return dataclasses.replace(result, xs=xs, x=attractor.x, g=attractor.g)


def _check_arguments(
    field: ETField, x0: Tensor, numbers: dict[str, float | None], counts: dict[str, int], method: SearchMethod
) -> None:
    """ValueError / TypeError naming the first bad argument of :func:`find_attractor`."""
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    check_tokens("x0", x0, field.model.dim)  # a dense, finite floating tensor (..., N, D)
    if x0.shape[:-2].numel() == 0:
        raise ValueError(f"x0 has an empty batch: shape {tuple(x0.shape)} (*batch, N, D); give at least one sample")
    check_mask(field.mask, x0)
    for name, value in numbers.items():
        check_positive(name, value)
    if method not in SEARCH_METHODS:
        raise ValueError(f"method must be one of {SEARCH_METHODS}, got {method!r}")
    for name, count in counts.items():
        check_positive(name, count, integer=True)
    check_lyapunov_neuron(field, "find_attractor")  # (before the flow; certify checks it too)


def find_attractor(
    field: ETField,
    x0: Tensor,
    *,
    tol: float | None = None,
    handoff: float = HANDOFF,
    handoffs: int = HANDOFFS,
    flow: bool = True,
    method: SearchMethod = "newton",
    max_iter: int = 200,
    cg_max_iter: int = 100,
    lanczos_iterations: int = 32,
    zero_tol: float = 1e-6,
    segment: float = SEGMENT,
    max_segments: int = MAX_SEGMENTS,
    rtol: float = FLOW_RTOL,
    atol: float = FLOW_ATOL,
    implicit: Implicit | None = None,
    seed: int = 0,
) -> Attractor:
    """The attractor of the flow ``tau dx/dt = -dE/dg`` that starts at ``x0``, certified, or a status saying why not.

    Any energy model: the geometry follows its neuron, and a neuron of Euclidean geometry (e.g. the identity) has its
    attractors at fixed points in ``x`` (``geometry="x"`` for every sample, no rescaling of the flow).

    Args:
        field: the vector field (its bound mask is used: ``(N, N)`` or ``(*batch, N, N)``).
        x0: initial states ``(*batch, N, D)``.
        tol: the certificate's tolerance on the RMS gradient (``T dE/dg`` on the spheres, the centred ``dE/dg`` in
            ``x``); default :func:`default_tol` (1e-8 in float64, 1e-4 in float32).
        handoff: the first hand-off level: the flow runs until RMS ``|T dE/dg| <= handoff`` before Newton.
        handoffs: hand-off levels at most (``handoff``, ``handoff / 10``, ...): a sample whose Newton point is not
            certified (not tied to the flow by the basin test, a saddle, ...) flows on to the next level and is
            examined again; after the last level it keeps its status (e.g. ``"unsettled"``).
        flow: ``False`` skips the flow phase: ``x0`` is held to be in the basin of the point Newton reaches from it
            (e.g. a critical point already), so the status does not wait on the basin test; ``settled`` still
            reports it, made from ``x0``.
        method: ``"newton"`` (trust-region Riemannian Newton, gradient descent as the fallback) or
            ``"gradient"`` (Riemannian gradient descent only, for comparison).
        max_iter, cg_max_iter: Newton iterations, and conjugate-gradient steps per Newton iteration.
        lanczos_iterations: Krylov vectors of the certificate (at most the tangent dimension); the smallest Ritz
            value bounds the smallest eigenvalue from above, so a saddle whose negative curvature Lanczos has not
            resolved could pass as stable: raise it for large states.
        zero_tol: an eigenvalue ``|lambda| <= zero_tol * max |lambda|`` counts as zero (kind ``"degenerate"``).
        segment, max_segments, rtol, atol: the flow phase: dopri5 on et-ode's loop with each sample's own steps
            (shared across the batch for a :class:`~et_ode.GraphMask`) and these tolerances, segments of
            ``segment * tau`` between rescalings, at most ``max_segments`` of them per hand-off level. A sample
            whose segment needs more than :data:`~et_ode.equilibrium.certify.FLOW_MAX_STEPS` steps (a flow too
            stiff to follow, e.g. a token shrinking through ``x = 0``) stops flowing and keeps the status of its
            examination there.
        implicit: the conjugate-gradient solve of the implicit backward pass, an :class:`~et_ode.Implicit`
            (default ``Implicit()``: its dtype-aware tolerance and iteration cap).
        seed: the Lanczos start vector.

    Returns:
        An :class:`Attractor`, per sample: the point (``x``, ``g``), its status (``"certified"`` or why not), its
        kind and certificate.

    Raises:
        TypeError: ``field`` is not an ETField, ``implicit`` not an Implicit, or ``x0`` not a floating tensor.
        ValueError: a bad argument, named: ``x0`` of the wrong shape, empty or not finite, a mask that does not fit
            it, a count or tolerance that is not positive, an unknown ``method``, or a model whose ``gamma`` is not
            positive.
        et_ode.backend.memory.OutOfMemoryError: the search ran out of memory (naming ``x0``'s shape and the bytes
            asked for).
    """
    tol = default_tol(x0.dtype) if tol is None and isinstance(x0, Tensor) else tol
    implicit = Implicit() if implicit is None else implicit
    if not isinstance(implicit, Implicit):
        raise TypeError(f"implicit must be an et_ode.Implicit, got {type(implicit).__name__}")
    _check_arguments(
        field,
        x0,
        dict(tol=tol, handoff=handoff, zero_tol=zero_tol, segment=segment),
        dict(
            handoffs=handoffs,
            max_iter=max_iter,
            cg_max_iter=cg_max_iter,
            max_segments=max_segments,
            lanczos_iterations=lanczos_iterations,
        ),
        method,
    )
    assert tol is not None
    evaluations_before = field.nfe
    with memory_named(f"find_attractor: x0 of shape {tuple(x0.shape)} ({x0.dtype}, {x0.device})", MEMORY_ADVICE):
        flat, flat_field = flatten(field, x0)
        found, flow_evaluations = settle(
            flat_field,
            flat,
            flow=flow,
            handoff=handoff,
            handoffs=handoffs,
            phase=FlowPhase(segment=segment, max_segments=max_segments, rtol=rtol, atol=atol),
            tol=tol,
            method=method,
            max_iter=max_iter,
            cg_max_iter=cg_max_iter,
            lanczos_iterations=lanczos_iterations,
            zero_tol=zero_tol,
            seed=seed,
        )
        return differentiable(
            flat_field,
            found,
            x0.shape[:-2],
            implicit_tol=implicit.tol or default_implicit_tol(x0.dtype),
            implicit_max_iter=implicit.max_iter,
            flow_evaluations=flow_evaluations,
            evaluations=field.nfe - evaluations_before,
        )


# -- reading a model's answer at the attractor ----------------------------------------------------------------------


@dataclass(frozen=True)
class AttractorReadout:
    """Read the answer at the attractor: a model whose dynamics is an ``AttractorReadout(...)`` (instead of an
    :class:`~et_ode.Integration`) answers from :func:`find_attractor`'s ``g`` instead of the end of a solve.

    The answer is the certified attractor of the flow from ``x0``; parameter gradients are the implicit ones at that
    point, so a training step's memory and backward cost do not depend on how long the flow takes. ``x0`` (and so
    the encoder, positions and MASK token that make it) gets no gradient: an attractor depends on where the flow
    starts only through its basin. Samples that are not certified (any status but ``"certified"``) keep their value
    in the loss but give no gradient (``g`` detached there, instead of :class:`AttractorError`); the solution's
    ``status`` is then reached-end, and the :class:`Attractor` that :meth:`read` also returns says which.

    Args:
        tol: the certificate's tolerance on the RMS gradient (None: :func:`default_tol`, 1e-4 in float32).
        handoff: the flow phase's first hand-off level (:func:`find_attractor`).
        max_iter: Newton iterations per sample.
        implicit: the conjugate-gradient solve of the implicit backward pass (:class:`~et_ode.Implicit`).

    Raises:
        ValueError: ``tol``, ``handoff`` or ``max_iter`` is not positive (named).
        TypeError: ``implicit`` is not an Implicit.
    """

    tol: float | None = None
    handoff: float = HANDOFF
    max_iter: int = 200
    implicit: Implicit = Implicit()

    def __post_init__(self) -> None:
        check_positive("AttractorReadout.tol", self.tol, optional=True)
        check_positive("AttractorReadout.handoff", self.handoff)
        check_positive("AttractorReadout.max_iter", self.max_iter, integer=True)
        if not isinstance(self.implicit, Implicit):
            raise TypeError(f"AttractorReadout.implicit must be an et_ode.Implicit, got {type(self.implicit).__name__}")

    def read(self, field: ETField, x0: Tensor) -> tuple[Solution, Attractor]:
        """The attractor from ``x0 (*batch, N, D)`` as a one-state :class:`~et_ode.Solution` (``t_final`` is
        infinite; ``status`` is steady state when every sample is certified, else reached-end; ``nfe_forward``
        counts every evaluation and Hessian-vector product of the search) and the :class:`Attractor` itself.

        Args:
            field: the model's ET field.
            x0: the initial states ``(*batch, N, D)``.

        Returns:
            The one-state solution (``x`` and ``g`` ``(*batch, N, D)``, ``ts = [inf]``) and the attractor.

        Raises:
            TypeError: ``field`` is not an ETField or ``x0`` not a floating tensor.
            ValueError: ``x0`` of the wrong shape, empty or not finite, or a mask that does not fit it.
        """
        started = time.perf_counter()
        found = find_attractor(field, x0, tol=self.tol, handoff=self.handoff, max_iter=self.max_iter, implicit=self.implicit)
        certified = found.certified
        g = found.g
        if g.requires_grad and not bool(certified.all()):
            g = torch.where(certified[..., None, None], g, g.detach())
        status = Status.STEADY_STATE if bool(certified.all()) else Status.REACHED_END
        stats = SolveStats(
            nfe_forward=found.evaluations,
            accepted_steps=int(found.iterations.sum()),
            rejected_steps=0,
            wall_time=time.perf_counter() - started,
            t_final=math.inf,
            status=status,
            field=field,
            nfe_at_return=field.nfe,
            stop_times=torch.full(x0.shape[:-2], math.inf, dtype=torch.float64),
            steady_state_measure="tangent_gradient",
        )
        ts = torch.tensor([math.inf], dtype=torch.float64)
        return Solution(ts=ts, xs=found.x[None], x=found.x, g=g, stats=stats, field=field), found

    def answer(self, field: ETField, x0: Tensor) -> Solution:
        """The solution a model reads its answer from: the attractor as :meth:`read` gives it.

        Args:
            field: the model's ET field.
            x0: the initial states ``(*batch, N, D)``.

        Returns:
            The one-state solution; ``g`` ``(*batch, N, D)`` is the answer.

        Raises:
            TypeError: ``field`` is not an ETField or ``x0`` not a floating tensor.
            ValueError: ``x0`` of the wrong shape, empty or not finite, or a mask that does not fit it.
        """
        return self.read(field, x0)[0]
