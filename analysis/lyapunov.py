"""Is the energy a Lyapunov function along this trajectory?

Three checks, on the saved states of a solution:

1. **Energy descent**: ``E(t_{k+1}) - E(t_k) <= tol`` for every saved interval.
2. **The rate**: the exact ``dE/dt = -(1/tau) sum_A (dE/dg_A)^T M_A (dE/dg_A)`` (the field's ``dE_dt``) is
   ``<= 0`` at every saved state, and the measured change ``E(t_{k+1}) - E(t_k)`` equals its integral,
   first estimated by the trapezoid rule from the two ends; where that disagrees, the interval is
   re-evaluated densely: the ODE is re-integrated from ``x(t_k)`` at tight tolerance with the exact
   ``dE/dt`` as an extra state, so the adaptive solver's own steps integrate it (a solution that saved only
   its two ends, ``solve(field, x0, t=(0.0, 50.0))``, is checked correctly, over one interval).
3. **The metric**: ``M_A`` is positive semi-definite. For the LayerNorm neuron that is ``gamma > 0`` (``eps > 0``
   always): its eigenvalues are ``0`` (all-ones), ``gamma eps / sigma^3`` (radial) and ``gamma / sigma`` (the
   rest). For any other neuron the eigenvalues of every token's dense ``M_A`` along the trajectory are checked.

A too-large Euler step shows up as energy rises and rate mismatches; ``gamma < 0`` as a non-PSD
metric, a positive ``dE/dt`` and energy rises. Every violation has its sample, kind, times and size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor
from torchdiffeq import odeint
from tqdm.auto import tqdm

from et_ode import ETField, LayerNormNeuron, Solution, SolveError
from et_ode.analysis._tables import Table, record
from et_ode.analysis.convergence import flat_field, flat_states
from et_ode.backend.validation import check_positive

Kind = Literal["energy rise", "dE/dt mismatch", "dE/dt > 0", "M not PSD"]
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclass
class Violation:
    """One failed check: ``size`` exceeded ``allowed`` on ``[t0, t1]`` (equal times: at one state).

    Attributes:
        sample: the sample's index in the batch.
        kind: the check: ``"energy rise"``, ``"dE/dt mismatch"``, ``"dE/dt > 0"`` or ``"M not PSD"``.
        t0: the start of the interval.
        t1: its end.
        size: the measured quantity.
        allowed: the largest value it may take.
    """

    sample: int
    kind: Kind
    t0: float
    t1: float
    size: float
    allowed: float


@dataclass
class LyapunovReport(Table):
    """Verdicts per sample and every violation.

    Attributes:
        passed: ``passed[b]``: both ``descends[b]`` and ``follows_rate[b]``.
        descends: ``descends[b]``: the energy is a Lyapunov function along sample ``b`` (no energy rise, no positive
            ``dE/dt``, ``M`` PSD).
        follows_rate: ``follows_rate[b]``: its measured energy changes match the exact ``dE/dt`` (a discretisation
            that does not follow the ODE fails this one).
        violations: every failed check, by sample, time and kind.
        max_energy_rise: ``max_energy_rise[b]``, the largest ``E(t_{k+1}) - E(t_k)`` (negative when the energy
            always fell).
        max_mismatch: ``max_mismatch[b]``, the largest ``|measured - integrated|`` change of energy over an interval,
            relative to ``|integrated| + tol`` (trapezoid, or dense re-evaluation where the trapezoid disagreed).
        gamma: the LayerNorm neuron's ``gamma`` (None for another neuron).
        eps: the LayerNorm neuron's ``eps`` (None for another neuron).
        m_min_eigenvalue: the smallest non-zero eigenvalue (on the directions the neuron's ``project`` keeps) of
            any ``M_A`` over the trajectory.
        m_psd: every ``M_A`` is positive semi-definite.
        neuron: the neuron's class name.
        intervals: the number of intervals between saved states checked.
        dense_rechecks: the intervals re-evaluated densely.
        settings: the tolerances and dense points used.
    """

    passed: list[bool]
    descends: list[bool]
    follows_rate: list[bool]
    violations: list[Violation]
    max_energy_rise: list[float]
    max_mismatch: list[float]
    gamma: float | None
    eps: float | None
    m_min_eigenvalue: float
    m_psd: bool
    neuron: str
    intervals: int
    dense_rechecks: int
    settings: dict = field(default_factory=dict)

    @property
    def all_passed(self) -> bool:
        return all(self.passed)

    def table(self, max_rows: int = 20) -> str:
        """Markdown: a verdict per sample, then the violations.

        Args:
            max_rows: the most violations listed.

        Returns:
            The Markdown text.
        """
        neuron = (
            f"gamma = {self.gamma:.6g}, eps = {self.eps:.3g}"
            if self.gamma is not None and self.eps is not None
            else f"neuron {self.neuron}"
        )
        lines = [
            f"M positive semi-definite: {'yes' if self.m_psd else 'NO'} ({neuron}, smallest non-zero eigenvalue of M "
            f"along the trajectory {self.m_min_eigenvalue:.3g}); {self.intervals} intervals, {self.dense_rechecks} "
            "re-evaluated densely.",
            "",
            "| sample | energy descends (Lyapunov) | follows the exact dE/dt | violations | "
            "largest energy rise | largest relative dE/dt mismatch |",
            "|---|---|---|---|---|---|",
        ]
        for b in range(len(self.passed)):
            count = sum(v.sample == b for v in self.violations)
            lines.append(
                f"| {b} | {'yes' if self.descends[b] else 'NO'} | {'yes' if self.follows_rate[b] else 'NO'} | "
                f"{count} | {self.max_energy_rise[b]:.3g} | {self.max_mismatch[b]:.3g} |"
            )
        if self.violations:
            lines += ["", "| sample | kind | t start | t end | size | allowed |", "|---|---|---|---|---|---|"]
            for v in self.violations[:max_rows]:
                lines.append(f"| {v.sample} | {v.kind} | {v.t0:.6g} | {v.t1:.6g} | {v.size:.3g} | {v.allowed:.3g} |")
            if len(self.violations) > max_rows:
                lines.append(f"| ... | {len(self.violations) - max_rows} more | | | | |")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return record(self, derived=("all_passed",))


def metric_spectrum(field: ETField, xs: Tensor) -> tuple[bool, float]:
    """Whether every ``M_A`` is positive semi-definite over all tokens of the states ``xs`` (``(..., N, D)``), and
    the smallest non-zero eigenvalue of any ``M_A`` (on the directions the neuron's ``project`` keeps): in closed
    form for the LayerNorm neuron (positive semi-definite exactly when ``gamma > 0``), from every token's dense
    ``M_A`` (``D`` Hessian-vector products) for another.

    Args:
        field: the vector field.
        xs: states ``(..., N, D)``.

    Returns:
        ``(positive semi-definite, smallest non-zero eigenvalue)``.
    """
    neuron = field.model.neuron
    if isinstance(neuron, LayerNormNeuron):
        gamma = float(neuron.gamma.detach())
        with torch.no_grad():
            sigma = (xs - xs.mean(dim=-1, keepdim=True)).square().mean(dim=-1).add(neuron.eps).sqrt()
            eigenvalues = torch.stack([gamma * neuron.eps / sigma.pow(3), gamma / sigma])
        return gamma > 0 and neuron.eps > 0, float(eigenvalues.min())
    with torch.no_grad():
        metric = neuron.metric(xs)
        values = torch.linalg.eigvalsh((metric + metric.transpose(-1, -2)) / 2)
    largest = float(values.abs().max()) if values.numel() else 0.0
    kept = values[..., neuron.dim - neuron.free_dimension() :]
    psd = float(values.min()) >= -1e3 * torch.finfo(xs.dtype).eps * max(largest, 1.0)
    return psd, float(kept.min())


ANALYSIS_MAX_STEPS = 10_000  # the step budget of an analysis integration (as et_ode.solve's max_steps)
_ADAPTIVE = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")


def bounded_odeint(
    func: Any,
    y0: Any,
    grid: Tensor,
    *,
    method: str,
    rtol: float,
    atol: float,
    what: str,
    max_steps: int = ANALYSIS_MAX_STEPS,
) -> Any:
    """torchdiffeq's ``odeint`` with a step budget of ``max_steps`` (adaptive methods; a fixed method takes the
    grid's steps).

    Raises:
        ValueError: ``max_steps`` is not a positive integer.
        et_ode.SolveError: the integration exceeds the budget or cannot go on (step-size underflow, a state too
            large): the message names ``what`` and the interval, instead of torchdiffeq's AssertionError.
    """
    check_positive("max_steps", max_steps, integer=True)
    options = {"max_num_steps": max_steps} if method in _ADAPTIVE else None
    try:
        return odeint(func, y0, grid, method=method, rtol=rtol, atol=atol, options=options)
    except AssertionError as error:
        start, end = float(grid[0]), float(grid[-1])
        raise SolveError(
            f"{what}: the {method} integration from t={start:.6g} to t={end:.6g} stopped: {error} (at "
            f"most {max_steps} steps; a horizon or state too large for the tolerances)",
            time=start,
            solution=None,
        ) from None


class _WithEnergyRate(torch.nn.Module):
    """The field with the exact ``dE/dt`` as an extra state: integrating ``(x, I)`` gives the energy change ``I``
    along the re-integrated path at the adaptive solver's own accuracy (a fixed quadrature misses fast
    transients inside a long interval, e.g. a solve that saved only its two ends)."""

    def __init__(self, field: ETField) -> None:
        super().__init__()
        self.field = field

    def forward(self, t: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x = state[0]
        velocity = self.field.velocity(x)
        return velocity, self.field.dE_dt(x, velocity).to(state[1].dtype)


def check_lyapunov(
    solution: Solution,
    *,
    energy_rtol: float | None = None,
    energy_atol: float = 0.0,
    match_rtol: float = 0.05,
    dense_points: int = 16,
    progress: bool = False,
    max_steps: int = ANALYSIS_MAX_STEPS,
) -> LyapunovReport:
    """Check that the energy is a Lyapunov function along ``solution`` (see the module docstring).

    Args:
        solution: a solve with saved states (``save="all"`` or ``"steps"``), at least two times; its field (with
            its mask) is checked, including its neuron's metric (the LayerNorm neuron's ``gamma`` and ``eps``).
        energy_rtol, energy_atol: an interval may raise the energy by ``energy_rtol max|E| + energy_atol``
            (rounding; ``max|E|`` the largest ``|E|`` of the sample along the trajectory, since an energy is defined
            up to a constant and a value near zero says nothing of its rounding; default ``energy_rtol`` is ``100``
            machine epsilons of the states' dtype).
        match_rtol: allowed relative difference between the measured and the integrated change of energy.
        dense_points: saved times (even) per interval of the dense re-evaluation; the solver steps adaptively
            between them.
        progress: show a progress bar over the dense re-evaluations.
        max_steps: the step budget of each dense re-evaluation (:class:`et_ode.SolveError` beyond it, or where it
            cannot go on).
    """
    xs = flat_states(solution)
    if xs.shape[0] < 2:
        raise ValueError(
            f"solution has {xs.shape[0]} saved time(s); the Lyapunov check needs at least 2: solve with "
            f'save="all" (e.g. on t=torch.linspace(0, t1, 51)) or save="steps"'
        )
    if not (isinstance(dense_points, int) and dense_points >= 2 and dense_points % 2 == 0):
        raise ValueError(f"dense_points must be an even integer >= 2, got {dense_points!r}")
    check_positive("match_rtol", match_rtol)
    finfo = torch.finfo(xs.dtype)
    energy_rtol = 100 * finfo.eps if energy_rtol is None else energy_rtol
    field = flat_field(solution)
    neuron = field.model.neuron
    ts = solution.ts.detach().to(torch.float64).cpu()
    steps, batch = xs.shape[0] - 1, xs.shape[1]
    with torch.no_grad():
        energy = field.energy(xs).to(torch.float64).cpu()  # (T, B)
        velocity = field.velocity(xs)
        rate = field.dE_dt(xs, velocity).to(torch.float64).cpu()  # exact dE/dt, (T, B)
        # the rounding scale of that sum: the size of its terms dE/dg . dg/dt = -tau dx/dt . dg/dt
        rate_scale = (field.tau * (velocity * field.dg_dt(xs, velocity)).abs().sum(dim=(-1, -2))).to(torch.float64).cpu()
    m_psd, m_min = metric_spectrum(field, xs)
    violations: list[Violation] = []
    if not m_psd:
        violations += [Violation(b, "M not PSD", float(ts[0]), float(ts[-1]), m_min, 0.0) for b in range(batch)]

    rate_allowed = 1e3 * finfo.eps * rate_scale
    for k, b in (rate > rate_allowed).nonzero().tolist():
        violations.append(
            Violation(b, "dE/dt > 0", float(ts[k]), float(ts[k]), float(rate[k, b]), float(rate_allowed[k, b]))
        )

    h = (ts[1:] - ts[:-1])[:, None]  # (T-1, 1)
    rise = energy[1:] - energy[:-1]  # (T-1, B)
    allowed = (energy_rtol * energy.abs().amax(dim=0) + energy_atol).expand_as(rise)  # (T-1, B)
    for k, b in (rise > allowed).nonzero().tolist():
        violations.append(
            Violation(b, "energy rise", float(ts[k]), float(ts[k + 1]), float(rise[k, b]), float(allowed[k, b]))
        )

    integral = h * (rate[1:] + rate[:-1]) / 2  # trapezoid
    close = (rise - integral).abs() <= match_rtol * torch.maximum(integral.abs(), rise.abs()) + allowed
    suspicious = (~close).nonzero().tolist()
    intervals = sorted({k for k, _ in suspicious})
    dense_rtol, dense_atol = (1e-8, 1e-10) if xs.dtype == torch.float64 else (1e-6, 1e-8)
    for k in tqdm(intervals, desc="dense dE/dt re-evaluation", disable=not progress or not intervals):
        grid = torch.linspace(float(ts[k]), float(ts[k + 1]), dense_points + 1, dtype=torch.float64)
        with torch.no_grad():  # the energy's change integrated as an extra state: the solver's steps place the points
            path, gained = bounded_odeint(
                _WithEnergyRate(field),
                (xs[k], xs.new_zeros(batch)),
                grid.to(xs.device),
                rtol=dense_rtol,
                atol=dense_atol,
                method="dopri5",
                max_steps=max_steps,
                what="check_lyapunov's dense re-evaluation",
            )
        del path
        dense = gained[-1].to(torch.float64).cpu()
        redo = ~close[k]
        integral[k, redo] = dense[redo]
    mismatch = (rise - integral).abs()
    limit = match_rtol * integral.abs() + allowed
    for k, b in suspicious:
        if mismatch[k, b] > limit[k, b]:
            violations.append(
                Violation(b, "dE/dt mismatch", float(ts[k]), float(ts[k + 1]), float(mismatch[k, b]), float(limit[k, b]))
            )
    relative = mismatch / (integral.abs() + allowed).clamp_min(finfo.tiny)
    relative[~torch.isfinite(relative)] = math.inf
    violations.sort(key=lambda v: (v.sample, v.t0, KINDS.index(v.kind)))
    flagged = {v.sample for v in violations}
    off_rate = {v.sample for v in violations if v.kind == "dE/dt mismatch"}
    not_descending = {v.sample for v in violations if v.kind != "dE/dt mismatch"}
    return LyapunovReport(
        passed=[b not in flagged for b in range(batch)],
        descends=[b not in not_descending for b in range(batch)],
        follows_rate=[b not in off_rate for b in range(batch)],
        violations=violations,
        max_energy_rise=rise.max(dim=0).values.tolist(),
        max_mismatch=relative.max(dim=0).values.tolist(),
        gamma=float(neuron.gamma.detach()) if isinstance(neuron, LayerNormNeuron) else None,
        eps=neuron.eps if isinstance(neuron, LayerNormNeuron) else None,
        m_min_eigenvalue=m_min,
        m_psd=m_psd,
        neuron=type(neuron).__name__,
        intervals=steps,
        dense_rechecks=len(intervals),
        settings={
            "energy_rtol": energy_rtol,
            "energy_atol": energy_atol,
            "match_rtol": match_rtol,
            "dense_points": dense_points,
        },
    )
