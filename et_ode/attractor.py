"""The attractor a flow ends in, found fast and certified: ``find_attractor``.

The ET's flow ``tau dx/dt = -dE/dg`` reaches its answer only as a power law in ``t`` (:mod:`et_ode.manifold`):
``x`` drifts outward, each token's ``g_A - delta`` tends to the sphere of radius ``gamma sqrt(D)``, and ``g``
tends to a critical point of ``E`` on the product of those spheres. ``find_attractor`` gets there in three phases:

1. **Flow** (which attractor): the ET's own flow (dopri5) from ``x0`` until the basin is settled, the hand-off
   criterion: RMS ``|T dE/dg| <= handoff`` per sample (``T`` the tangent projection onto the spheres). Between
   segments each sample that has drifted outward is shrunk by one common factor (to mean ``sigma = 1``), which
   leaves the path of ``g`` unchanged (a common time change, up to O(eps)) and undoes the flow's slow-down.
2. **Newton** (where exactly): Riemannian Newton on the spheres: truncated (Steihaug) conjugate gradients on the
   Riemannian Hessian inside a trust region, with the ratio of actual to predicted decrease of ``E`` deciding
   each step, so it never climbs to a saddle; Riemannian gradient descent with an Armijo step as the fallback
   when the trust region collapses (and as ``method="gradient"``). Samples that reach RMS ``|T dE/dg| < tol``
   leave the batch, so finished samples stop costing.
3. **Certificate**: RMS ``|T dE/dg|``, the smallest eigenvalue of the Riemannian Hessian on the tangent space
   (Lanczos, the all-ones and radial zero modes excluded) and the kind: ``"stable"`` (a strict local minimum),
   ``"saddle"`` or ``"degenerate"``.

**Off the spheres.** The spheres are where the flow ends only when the outward force ``rho_A = -s_A . dE/dg_A``
(``s_A`` the unit radial direction) is positive for every token. Where it is not, at the hand-off or at the point
found on the spheres, the attractor may be an ordinary fixed point in ``x`` (``|xt|`` finite: ``x`` truly stops,
up to a drift along the all-ones vector, which leaves ``g`` unchanged). Such points are the local minima of
``E(LayerNorm(x))`` over centred ``x``; that sample is then continued by the same trust-region Newton method
in ``x`` from the flow's state (the Hessian of ``E(LayerNorm(x))``, which equals ``M H M`` at the fixed point and
has the inertia of the flow's Jacobian ``-(1/tau) H M`` there) and reported with ``geometry="x"``.

**Scale.** On the spheres the returned ``x`` has every token centred with ``mean(xt^2) = S^2``, ``S`` so large
that ``eps / S^2`` is below the dtype's rounding: ``g = LayerNorm(x)`` then lies on the flow's limit spheres of
radius ``gamma sqrt(D)`` to rounding (a flow continued from it is slowed by ``1/S``; rescale first).

**Gradients.** ``Attractor.g`` is differentiable with respect to the model's parameters by the implicit function
theorem at the certified point (:func:`et_ode.gradients.implicit_attractor`); samples that are not certified
stable refuse to be differentiated (:class:`AttractorError` in the backward pass). ``x0`` gets no gradient.

Shapes: ``x0`` is ``(*batch, N, D)``; per-sample results are ``(*batch,)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_mask, check_tokens
from .certify import METHODS, Attractor, certify, default_tol, flatten, limit_scale
from .field import ETField
from .gradients import AttractorError, default_implicit_tol
from .solution import Solution, SolveStats, Status
from .solve import solve
from .solvers import Adaptive
from .stopping import SteadyState

__all__ = ["Attractor", "AttractorError", "AttractorReadout", "default_tol", "find_attractor", "limit_scale"]


# -- the flow phase -----------------------------------------------------------------------------------------------


def _mean_scale(x: Tensor) -> Tensor:
    """Shrink each sample by one factor so that its tokens' RMS ``sigma`` is at most 1 (``g`` unchanged up to
    O(eps)). Never grown: a flow heading inward, to a fixed point in ``x``, is left alone."""
    xt = x - x.mean(dim=-1, keepdim=True)
    rms = xt.square().mean(dim=(-1, -2), keepdim=True).sqrt()
    return x / rms.clamp_min(1.0)


def _flow(field: ETField, x: Tensor, *, handoff: float, segment: float, max_segments: int, rtol: float,
          atol: float) -> Tensor:
    """The ET's flow per sample until RMS ``|T dE/dg| <= handoff``, in segments of ``segment * tau`` between
    common rescalings; a sample that has not got there after ``max_segments`` segments stops where it is."""
    per_sample_mask = field.mask if isinstance(field.mask, Tensor) and field.mask.dim() == 3 else None
    x = x.clone()
    active = torch.arange(x.shape[0])
    for _ in range(max_segments):
        if not len(active):
            break
        bound = field.with_mask(per_sample_mask[active]) if per_sample_mask is not None else field
        out = solve(bound, _mean_scale(x[active]), (0.0, segment * field.tau), solver=Adaptive(rtol=rtol, atol=atol),
                    stop=SteadyState(handoff, measure="tangent_gradient", per_sample=True), save="final",
                    max_steps=100_000)
        x[active] = out.x.detach()
        stop_times = out.stats.stop_times
        assert stop_times is not None  # a per-sample stop records each sample's stop time
        done = stop_times < segment * field.tau * (1 - 1e-12)
        if out.stats.status.value == "steady_state":
            done = torch.ones_like(done)
        active = active[~done]
    return x


# -- the public entry point ---------------------------------------------------------------------------------------


def find_attractor(field: ETField, x0: Tensor, *, tol: float | None = None, handoff: float = 0.1,
                   flow: bool = True, method: str = "newton", max_iter: int = 200, cg_max_iter: int = 100,
                   lanczos_iterations: int = 32, zero_tol: float = 1e-6, segment: float = 20.0,
                   max_segments: int = 50, rtol: float = 1e-4, atol: float = 1e-8, implicit_tol: float = 1e-10,
                   implicit_max_iter: int = 500, seed: int = 0) -> Attractor:
    """The attractor of the flow ``tau dx/dt = -dE/dg`` that starts at ``x0``, certified.

    Args:
        field: the vector field (its bound mask is used: ``(N, N)`` or ``(*batch, N, N)``).
        x0: initial states ``(*batch, N, D)``.
        tol: the certificate's tolerance on the RMS gradient (``T dE/dg`` on the spheres); default
            :func:`default_tol` (1e-8 in float64, 1e-4 in float32).
        handoff: the flow phase ends per sample once RMS ``|T dE/dg| <= handoff``: the basin is then settled
            (the flow has done the choosing; Newton only converges).
        flow: ``False`` skips the flow phase (``x0`` is already in the basin, e.g. the end of a solve).
        method: ``"newton"`` (trust-region Riemannian Newton, gradient descent as the fallback) or
            ``"gradient"`` (Riemannian gradient descent only, for comparison).
        max_iter, cg_max_iter: Newton iterations, and conjugate-gradient steps per Newton iteration.
        lanczos_iterations: Krylov vectors of the certificate (at most the tangent dimension); the smallest Ritz
            value bounds the smallest eigenvalue from above, so a saddle whose negative curvature Lanczos has not
            resolved could pass as stable: raise it for large states.
        zero_tol: an eigenvalue ``|lambda| <= zero_tol * max |lambda|`` counts as zero (kind ``"degenerate"``).
        segment, max_segments, rtol, atol: the flow phase: dopri5 tolerances, segments of ``segment * tau``
            between rescalings, at most ``max_segments`` of them.
        implicit_tol, implicit_max_iter: the conjugate-gradient solve of the implicit backward pass.
        seed: the Lanczos start vector.

    Returns an :class:`Attractor`. Raises ``ValueError`` / ``TypeError`` for bad arguments (naming them).
    """
    if not isinstance(field, ETField):
        raise TypeError(f"field must be an et_ode.ETField, got {type(field).__name__}")
    check_tokens("x0", x0, field.model.dim)
    if not x0.is_floating_point():
        raise TypeError(f"x0 must be a floating tensor, got {x0.dtype}")
    if not bool(torch.isfinite(x0).all()):
        raise ValueError("x0 has non-finite entries")
    check_mask(field.mask, x0)
    tol = default_tol(x0.dtype) if tol is None else tol
    for name, value in (("tol", tol), ("handoff", handoff), ("zero_tol", zero_tol), ("segment", segment),
                        ("implicit_tol", implicit_tol)):
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for name, value in (("max_iter", max_iter), ("cg_max_iter", cg_max_iter), ("max_segments", max_segments),
                        ("lanczos_iterations", lanczos_iterations), ("implicit_max_iter", implicit_max_iter)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not float(field.model.neuron.gamma.detach()) > 0:  # (before the flow; certify checks it too)
        raise ValueError("find_attractor needs gamma > 0 (the energy is then a Lyapunov function)")

    evaluations_before = field.nfe
    if flow:
        flat, flat_field = flatten(field, x0)
        with torch.no_grad():
            x0 = _flow(flat_field, flat, handoff=handoff, segment=segment, max_segments=max_segments, rtol=rtol,
                       atol=atol).reshape(x0.shape)
    return certify(field, x0, tol=tol, method=method, max_iter=max_iter, cg_max_iter=cg_max_iter,
                   lanczos_iterations=lanczos_iterations, zero_tol=zero_tol, implicit_tol=implicit_tol,
                   implicit_max_iter=implicit_max_iter, seed=seed, flow_evaluations=field.nfe - evaluations_before,
                   evaluations_before=evaluations_before)


# -- reading a model's answer at the attractor ----------------------------------------------------------------------


@dataclass(frozen=True)
class AttractorReadout:
    """Read the answer at the attractor: ``Integration(attractor=AttractorReadout(...))`` (the models' forward
    pass then returns :func:`find_attractor`'s ``g`` instead of the end of a solve).

    The answer is the certified attractor of the flow from ``x0``; parameter gradients are the implicit ones at that
    point, so a training step's memory and backward cost do not depend on how long the flow takes. ``x0`` (and so
    the encoder, positions and MASK token that make it) gets no gradient: an attractor depends on where the flow
    starts only through its basin. Samples that are not certified stable attractors (a saddle, a degenerate point, a
    search that ran out of ``max_iter``) keep their value in the loss but give no gradient (``g`` detached there,
    instead of :class:`AttractorError`); the solution's ``status`` is then reached-end, and the :class:`Attractor`
    that :meth:`read` also returns says which (``certified``).

    Args:
        tol: the certificate's tolerance on RMS ``|T dE/dg|`` (None: :func:`default_tol`, 1e-4 in float32).
        handoff: the flow phase's hand-off (:func:`find_attractor`).
        max_iter: Newton iterations per sample.
        implicit_tol, implicit_max_iter: the conjugate-gradient solve of the implicit backward pass (relative
            residual; None: :func:`~et_ode.gradients.default_implicit_tol`, 1e-8 in float64, 1e-3 in float32).
    """

    tol: float | None = None
    handoff: float = 0.1
    max_iter: int = 200
    implicit_tol: float | None = None
    implicit_max_iter: int = 200

    def __post_init__(self) -> None:
        for name in ("tol", "handoff", "implicit_tol"):
            value = getattr(self, name)
            if value is None and name != "handoff":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"AttractorReadout.{name} must be a positive finite number, got {value!r}")
        for name in ("max_iter", "implicit_max_iter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttractorReadout.{name} must be a positive integer, got {value!r}")

    def read(self, field: ETField, x0: Tensor) -> tuple[Solution, Attractor]:
        """The attractor from ``x0 (*batch, N, D)`` as a one-state :class:`~et_ode.Solution` (``t_final`` is
        infinite; ``status`` is steady state when every sample is certified, else reached-end; ``nfe_forward``
        counts every evaluation and Hessian-vector product of the search) and the :class:`Attractor` itself."""
        started = time.perf_counter()
        found = find_attractor(field, x0, tol=self.tol, handoff=self.handoff, max_iter=self.max_iter,
                               implicit_tol=self.implicit_tol or default_implicit_tol(x0.dtype),
                               implicit_max_iter=self.implicit_max_iter)
        certified = found.certified
        g = found.g
        if g.requires_grad and not bool(certified.all()):
            g = torch.where(certified[..., None, None], g, g.detach())
        status = Status.STEADY_STATE if bool(certified.all()) else Status.REACHED_END
        stats = SolveStats(nfe_forward=found.evaluations, accepted_steps=int(found.iterations.sum()), rejected_steps=0,
                           wall_time=time.perf_counter() - started, t_final=math.inf, status=status, field=field,
                           nfe_at_return=field.nfe,
                           stop_times=torch.full(x0.shape[:-2], math.inf, dtype=torch.float64),
                           steady_state_measure="tangent_gradient")
        ts = torch.tensor([math.inf], dtype=torch.float64)
        return Solution(ts=ts, xs=found.x[None], x=found.x, g=g, stats=stats, field=field), found
