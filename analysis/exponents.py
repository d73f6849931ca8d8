"""The largest Lyapunov exponent of the ET flow by Benettin's method, in the flow's time or in intrinsic time.

:func:`lyapunov_exponent` follows a state and a small tangent perturbation of its ``g`` together, renormalising the
perturbation between spans. The plain flow slows down like ``1 / t`` (the token scales grow), so its exponent is a
finite-time one of the transient; with ``restart`` both states move on the limit spheres under
:class:`~et_ode.analysis.sphere.FixedScaleField`, where the rates do not decay and the exponent at a minimum tends to
``-(gamma / tau) lambda_min(Hess_R)``. A neuron of Euclidean geometry has no slow-down to undo: its plain flow
is measured in its chart (:mod:`et_ode.analysis.chart`), ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from et_ode import Adaptive, ETField, solve
from et_ode.analysis.chart import chart_for
from et_ode.analysis.lyapunov import ANALYSIS_MAX_STEPS, bounded_odeint
from et_ode.analysis.stability import batched_states
from et_ode.backend.validation import check_positive
from et_ode.integrators.solvers import ADAPTIVE_METHODS
from et_ode.linalg.krylov import per_sample, sample_dot


@dataclass
class LyapunovExponent:
    """Finite-time largest Lyapunov exponent per sample (measured in ``g``, per unit of time of the flow).

    Attributes:
        exponent: the exponent ``(B,)``.
        times: the renormalisation times ``(K,)``.
        running: the running estimate at ``times`` ``(K, B)``.
        d0: the size of the perturbation in ``g``.
        late: the growth rate over the second half of the renormalisations only ``(B,)``: the start's transient
            (the random perturbation's components along faster modes) is discarded, so it approaches the asymptotic
            exponent like ``exp(-gap T / 2)`` instead of ``1 / T``.
    """

    exponent: Tensor
    times: Tensor
    running: Tensor
    d0: float
    late: Tensor


@dataclass(frozen=True)
class Benettin:
    """The settings of Benettin's method: the reference state and its perturbations of ``g`` (size ``d0``) are
    integrated together over ``renormalizations`` equal spans of ``[0, t1]``, after each of which the perturbations
    are set back to size ``d0``.

    Attributes:
        t1: the end time.
        renormalizations: the number of spans.
        d0: the size of a perturbation in ``g``.
        solver: the adaptive solver of each span; its method one of torchdiffeq's (``ADAPTIVE_METHODS``), since the
            runs in intrinsic time hand its method and tolerances to torchdiffeq.
        seed: the random first perturbations.

    Raises:
        ValueError: ``t1`` or ``d0`` is not a positive number, ``renormalizations`` not a positive integer, or the
            solver's method not one of torchdiffeq's.
        TypeError: ``solver`` is not an :class:`~et_ode.Adaptive`, or ``seed`` not an integer.
    """

    t1: float = 20.0
    renormalizations: int = 20
    d0: float = 1e-6
    solver: Adaptive = Adaptive("dopri5", rtol=1e-10, atol=1e-12)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("t1", "d0"):
            check_positive(f"Benettin.{name}", getattr(self, name))
        check_positive("Benettin.renormalizations", self.renormalizations, integer=True)
        if not isinstance(self.solver, Adaptive):
            raise TypeError(f"Benettin.solver must be an et_ode.Adaptive, got {type(self.solver).__name__}")
        if self.solver.method not in ADAPTIVE_METHODS:
            raise ValueError(f"Benettin.solver's method must be one of {ADAPTIVE_METHODS}, got {self.solver.method!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"Benettin.seed must be an integer, got {self.seed!r}")


#: the settings of :func:`lyapunov_exponent` by default
EXPONENT_BENETTIN = Benettin(t1=10.0, solver=Adaptive("dopri5", rtol=1e-9, atol=1e-11))


def checked_benettin(benettin: object) -> Benettin:
    """``benettin`` itself; TypeError naming ``benettin`` if it is not a :class:`Benettin`."""
    if not isinstance(benettin, Benettin):
        raise TypeError(f"benettin must be a Benettin(...), got {type(benettin).__name__}")
    return benettin


def lyapunov_exponent(
    field: ETField,
    x0: Tensor,
    *,
    benettin: Benettin = EXPONENT_BENETTIN,
    restart: bool = False,
    progress: bool = False,
    max_steps: int = ANALYSIS_MAX_STEPS,
) -> LyapunovExponent:
    """Benettin's method: the growth rate of a small tangent perturbation of ``g`` (size ``d0``).

    The pair (reference, perturbed) is integrated together from 0 to ``t1`` in ``renormalizations`` spans;
    after each, the g-distance ``d`` is measured, ``log(d / d0)`` accumulated and the perturbation of ``x``
    rescaled to ``d0`` (the settings of :class:`Benettin`). Negative: nearby trajectories converge.

    With ``restart`` the exponent is measured in intrinsic time: both states start on the limit spheres and
    follow the :class:`~et_ode.analysis.sphere.FixedScaleField`, which keeps ``sigma`` fixed and the tangential
    rates at ``gamma / tau`` throughout (the limit of rescaling continuously). At a minimum it converges to
    ``-(gamma / tau) lambda_min(Hess_R)``. Rescaling only at the start of each span would be biased toward zero:
    within a span ``sigma`` grows like ``1 + kappa gamma t / tau`` (``kappa = rho / r``, the outward force over
    the radius), which slows the decay to ``-(lambda / kappa) ln(1 + kappa gamma Delta) / Delta``. Without
    ``restart`` the exponent is that of the plain flow, whose rates decay like ``1 / t``: a finite-time exponent
    of the transient.

    Each span's integration has a budget of ``max_steps`` steps (:class:`et_ode.SolveError` beyond it).

    Args:
        field: the vector field.
        x0: reference states ``(B, N, D)`` or ``(N, D)``.
        benettin: the spans, the perturbation's size and seed, and the solver.
        restart: measure in intrinsic time (on the limit spheres, fixed scale).
        progress: show a progress bar.
        max_steps: the step budget of each span.

    Returns:
        A :class:`LyapunovExponent`, its ``exponent`` ``(B,)``.

    Raises:
        TypeError: ``benettin`` is not a :class:`Benettin`.
        et_ode.SolveError: a span ran out of steps.
    """
    from tqdm.auto import tqdm

    x = batched_states(x0, field)
    benettin = checked_benettin(benettin)
    t1, renormalizations, d0 = benettin.t1, benettin.renormalizations, benettin.d0
    chart = chart_for(field)
    if restart:
        x = chart.canonical(x)
    generator = torch.Generator().manual_seed(benettin.seed)
    w = chart.projector(x)(torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device))
    w = w * d0 / per_sample(sample_dot(w, w).sqrt(), w)
    pair = torch.cat([x, x + chart.displacement(x, w)])
    fixed_scale = chart.steady_field()
    span = t1 / renormalizations
    logs, times = [], []
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    batch = x.shape[0]
    for k in tqdm(range(renormalizations), desc="Lyapunov exponent", disable=not progress, leave=False):
        if restart:
            pair = chart.canonical(pair)
            grid = torch.tensor([0.0, span], dtype=pair.dtype, device=pair.device)
            with torch.no_grad():
                pair = bounded_odeint(
                    fixed_scale,
                    pair,
                    grid,
                    method=benettin.solver.method,
                    rtol=benettin.solver.rtol,
                    atol=benettin.solver.atol,
                    max_steps=max_steps,
                    what="lyapunov_exponent (restart)",
                )[-1]
        else:
            pair = solve(field, pair, (0.0, span), solver=benettin.solver, save="final", max_steps=max_steps).x.detach()
        with torch.no_grad():
            gs = chart.coordinates(pair)
        dist = sample_dot(gs[batch:] - gs[:batch], gs[batch:] - gs[:batch]).sqrt()
        total += (dist / d0).log().to(torch.float64).cpu()
        logs.append(total / ((k + 1) * span))
        times.append((k + 1) * span)
        scale = per_sample(d0 / dist.clamp_min(torch.finfo(dist.dtype).tiny), pair[:batch])
        pair = torch.cat([pair[:batch], pair[:batch] + (pair[batch:] - pair[:batch]) * scale])
    running = torch.stack(logs)
    times_tensor = torch.tensor(times, dtype=torch.float64)
    half = renormalizations // 2 - 1
    before = running[half] * times_tensor[half] if half >= 0 else torch.zeros_like(total)
    late = (total - before) / (t1 - (times_tensor[half] if half >= 0 else 0.0))
    return LyapunovExponent(exponent=total / t1, times=times_tensor, running=running, d0=d0, late=late)
