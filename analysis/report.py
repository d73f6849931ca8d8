"""One call that solves a model and runs every check, writing a readable report.

``analyze(model, x0, integration)`` writes into a folder: ``report.md`` (read top to bottom: did it converge, is the
energy a Lyapunov function here, what kind of attractor), ``report.json`` (the same numbers, machine-readable) and
the PNGs it embeds. The ``et-ode analyze`` subcommand (:mod:`et_ode.cli.analyze`) is its command-line face;
:func:`random_model` and :func:`random_states` give the built-in random model and states.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from et_ode import (
    EnergyAttention,
    EnergyModel,
    EnergyTransformer,
    ETField,
    Integration,
    LayerNormNeuron,
    Solution,
    SolveError,
)
from et_ode.analysis.basin_probes import BasinProbe, basin_probe
from et_ode.analysis.convergence import ConvergenceReport, analyze_convergence, flat_field
from et_ode.analysis.exponents import Benettin, LyapunovExponent, lyapunov_exponent
from et_ode.analysis.landscape import LandscapeStudy, landscape_study
from et_ode.analysis.lyapunov import LyapunovReport, check_lyapunov
from et_ode.analysis.plots import plot_attention, plot_convergence, plot_energy_slice, plot_trajectories
from et_ode.analysis.spectra import HessianTrace, hessian_along, plot_hessian_along
from et_ode.analysis.stability import FixedPointSearch, StabilityReport, find_fixed_point, fixed_point_stability
from et_ode.energy.energies import HopfieldForm
from et_ode.integrators.solvers import Adaptive, EulerET
from et_ode.solving.integration import settings_to_dict
from et_ode.training.io import model_config

PathLike = str | os.PathLike[str]
#: the report's solve of the LayerNorm neuron unless told otherwise: dopri5 at tight tolerances to t1 = 30, a large
#: step budget (the flow slows like 1/t)
ANALYZE_INTEGRATION = Integration(solver=Adaptive(rtol=1e-6, atol=1e-8), t1=30.0, max_steps=100_000)
#: the report's solve of a Euclidean neuron unless told otherwise: its flow converges exponentially, so the end of the
#: span lies within a looser solve's error, which the Lyapunov check (made down to rounding) would judge
EUCLIDEAN_INTEGRATION = Integration(solver=Adaptive(rtol=1e-10, atol=1e-12), t1=30.0, max_steps=100_000)


def random_model(
    dim: int = 16,
    heads: int = 2,
    head_dim: int = 8,
    memories: int = 32,
    *,
    hopfield: HopfieldForm = "relu",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> EnergyTransformer:
    """The built-in random model: default initialisation from ``seed``, a random ``delta`` (std 0.3); the global
    random stream is restored afterwards.

    Args:
        dim, heads, head_dim, memories, hopfield: as in :class:`~et_ode.EnergyTransformer`.
        seed: the seed of the weights.
        dtype: the parameters' dtype.

    Returns:
        The :class:`~et_ode.EnergyTransformer`.
    """
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = EnergyTransformer(dim, heads, head_dim, memories, hopfield=hopfield).to(dtype)
        with torch.no_grad():
            model.neuron.delta.normal_(0.0, 0.3)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def random_states(model: EnergyModel, batch: int = 3, tokens: int = 8, seed: int = 1) -> Tensor:
    """Standard normal states for ``model`` in its dtype (float64 for a model without parameters), drawn from a
    generator seeded with ``seed`` (the global random stream is left alone).

    Args:
        model: the model (its ``dim`` is ``D``).
        batch: the number of states.
        tokens: the tokens per state.
        seed: the generator's seed.

    Returns:
        The states, ``(batch, tokens, D)``.
    """
    generator = torch.Generator().manual_seed(seed)
    reference = model.reference_tensor
    dtype = torch.float64 if reference is None else reference.dtype
    return torch.randn(batch, tokens, model.dim, generator=generator, dtype=dtype)


def _checked_states(x0: Tensor, model: EnergyModel) -> Tensor:
    """``x0`` as ``(batch, N, D)`` in the model's dtype and on its device (TypeError or ValueError naming ``x0``)."""
    if not isinstance(x0, Tensor):
        raise TypeError(f"x0 must be a tensor (batch, N, D), got {type(x0).__name__}")
    if x0.dim() == 2:
        x0 = x0[None]
    if x0.dim() != 3 or x0.shape[-1] != model.dim:
        raise ValueError(f"x0 must have shape (batch, N, D) with D={model.dim}, got {tuple(x0.shape)}")
    reference = model.reference_tensor
    return x0 if reference is None else x0.to(device=reference.device, dtype=reference.dtype)


def _describe_model(model: EnergyModel) -> dict[str, Any]:
    """The model's architecture as plain data: the ET's constructor arguments (``model_config``), or for any other
    model its class, neuron, token size and interactions."""
    if isinstance(model, EnergyTransformer):
        return {"model": "EnergyTransformer", **model_config(model)}
    return {
        "model": type(model).__name__,
        "neuron": type(model.neuron).__name__,
        "dim": model.dim,
        "interactions": {name: type(interaction).__name__ for name, interaction in model.interactions.items()},
    }


def _gamma(model: EnergyModel) -> float | None:
    """The LayerNorm neuron's ``gamma`` (None for another neuron)."""
    neuron = model.neuron
    return float(neuron.gamma.detach()) if isinstance(neuron, LayerNormNeuron) else None


def _clean(value: Any) -> Any:
    """JSON-safe: tensors to lists, non-finite floats to None, paths to strings."""
    if isinstance(value, Tensor):
        return _clean(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _solver_text(solver: dict[str, Any]) -> str:
    """``dopri5 (rtol 1e-06, atol 1e-08)`` from a solver's plain data (``settings_to_dict``)."""
    settings = ", ".join(
        f"{name} {value:.3g}" if isinstance(value, float) else f"{name} {value}"
        for name, value in solver.items()
        if name not in ("kind", "method", "options")
    )
    return f"{solver['kind']} {solver.get('method', '')}".rstrip() + (f" ({settings})" if settings else "")


@dataclass
class _Findings:
    """What :func:`analyze` found: the solve and each check (None where a check did not apply)."""

    solution: Solution
    failure: str | None  # the solve's error message when it stopped early (the checks use the partial trajectory)
    convergence: ConvergenceReport | None = None
    lyapunov: LyapunovReport | None = None
    fixed: FixedPointSearch | None = None
    stability: StabilityReport | None = None
    final_stability: StabilityReport | None = None
    exponent: LyapunovExponent | None = None
    intrinsic: LyapunovExponent | None = None
    basin: BasinProbe | None = None
    distance: list[float] | None = None  # RMS g-distance of each final state from its fixed point
    pictures: dict[str, str] = field(default_factory=dict)
    study: LandscapeStudy | None = None
    trace: HessianTrace | None = None


class _Stages:
    """The progress bar over the analysis's stages, and when each began."""

    def __init__(self, names: Sequence[str], progress: bool):
        self.bar = tqdm(names, desc="analyze", disable=not progress)
        self.started: dict[str, float] = {}

    def start(self, name: str) -> None:
        self.started[name] = time.perf_counter()
        self.bar.set_description(f"analyze: {name}")

    def seconds(self) -> dict[str, float]:
        """Close the bar; the seconds of each stage started (each until the next one began, the last until this call)."""
        self.bar.close()
        ends = list(self.started.values())[1:] + [time.perf_counter()]
        return {name: end - begin for (name, begin), end in zip(self.started.items(), ends, strict=True)}


STAGES = ("solve", "convergence", "Lyapunov check", "fixed point", "stability", "Lyapunov exponent", "basin probe")


def analyze(
    model: EnergyModel,
    x0: Tensor,
    integration: Integration | None = None,
    *,
    out: PathLike = "runs/analyze",
    tau: float = 1.0,
    points: int = 61,
    tol: float = 1e-3,
    fixed_point_tol: float = 1e-7,
    basin_radii: list[float] | None = None,
    basin_trials: int = 3,
    landscape: bool = False,
    source: str = "given EnergyTransformer",
    progress: bool = True,
) -> Path:
    """Solve, check and picture one model; return the folder holding ``report.md``, ``report.json`` and PNGs.

    Args:
        model: the energy, an :class:`et_ode.EnergyModel` (an EnergyTransformer, or any neuron and interactions: the
            checks follow its neuron's geometry, and those that need LayerNorm's spheres or an attention are left out
            with a note); the analysis runs on its device and in its dtype (float64 for tight checks). The
            built-in random model is :func:`random_model`; a saved one is read by
            :func:`et_ode.training.io.load_model`.
        x0: initial states ``(batch, N, D)`` or ``(N, D)`` (e.g. :func:`random_states`).
        integration: the solve: its solver, horizon ``t1`` and step budget (its gradient and stop as given); default
            :data:`ANALYZE_INTEGRATION` for the LayerNorm neuron, :data:`EUCLIDEAN_INTEGRATION` (rtol 1e-10) for a
            Euclidean neuron.
        out: the folder to write (created; files in it are overwritten).
        tau: the field's time constant.
        points: the number of saved times from 0 to ``t1`` (:class:`et_ode.EulerET` saves each of its steps).
        tol: convergence tolerance on RMS ``|dg/dt|`` (and on RMS ``|T dE/dg|``).
        fixed_point_tol: RMS ``|T dE/dg|`` at which the fixed-point search stops.
        basin_radii, basin_trials: the basin probe (default radii 0.01 ... 1).
        landscape: add the landscape study of sample 0 (:func:`~et_ode.analysis.landscape.landscape_study`:
            critical points of any index, saddle connections, basins, asymptotic rate, Lyapunov spectrum,
            continuation) and the Hessian's spectrum along every trajectory. Dense Hessians of dimension
            ``N (D - 2)``: meant for small models.
        source: how the report names the model (e.g. ``"loaded from runs/d/et_block.pt"``).
        progress: show tqdm progress bars.

    Returns:
        The folder ``out``.

    Raises:
        TypeError: ``model`` is not an EnergyModel, ``integration`` not an Integration or ``x0`` not a tensor.
        ValueError: ``x0`` of another token size than the model's, ``points`` below 3.
        et_ode.SolveError: the solve failed before saving any state.
    """
    if not isinstance(model, EnergyModel):
        raise TypeError(f"model must be an et_ode.EnergyModel (such as an EnergyTransformer), got {type(model).__name__}")
    if integration is None:
        integration = ANALYZE_INTEGRATION if model.neuron.geometry == "spheres" else EUCLIDEAN_INTEGRATION
    if not isinstance(integration, Integration):
        raise TypeError(f"integration must be an et_ode.Integration, got {type(integration).__name__}")
    if not (isinstance(points, int) and points >= 3):
        raise ValueError(f"points must be an integer >= 3, got {points!r}")
    started = time.perf_counter()
    states = _checked_states(x0, model)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    et_field = ETField(model, tau=tau)
    stages = _Stages([*STAGES, "pictures"] + (["landscape"] if landscape else []), progress)
    findings = _solve(et_field, states, integration, points, stages)
    _check_flow(findings, tol, stages, progress)
    gamma = _gamma(model)
    lyapunov_energy = gamma is None or gamma > 0  # other neurons are the user's to make convex
    if lyapunov_energy:
        _study_fixed_points(findings, et_field, states, fixed_point_tol, basin_radii, basin_trials, stages, progress)
    else:
        stages.bar.update(4)
    _draw(findings, et_field, folder, integration.solver.adaptive, stages)
    if landscape and lyapunov_energy:
        _study_landscape(findings, states, folder, stages, progress)
    timings = stages.seconds()
    summary = _summary(model, states, tau, integration, points, findings, source, fixed_point_tol)
    summary.update(timings_s=timings, total_time_s=time.perf_counter() - started)
    (folder / "report.json").write_text(json.dumps(_clean(summary), indent=2))
    (folder / "report.md").write_text(_markdown(summary, findings))
    return folder


def _solve(et_field: ETField, states: Tensor, integration: Integration, points: int, stages: _Stages) -> _Findings:
    """The trajectories on ``points`` saved times from 0 to ``t1`` (a failed solve's partial trajectory, with its
    message)."""
    stages.start("solve")
    grid = (
        None if isinstance(integration.solver, EulerET) else torch.linspace(0.0, integration.t1, points, dtype=torch.float64)
    )
    try:
        findings = _Findings(integration.solve(et_field, states, grid, save="all"), None)
    except SolveError as error:
        if error.solution is None:
            raise
        findings = _Findings(error.solution, str(error))
    stages.bar.update()
    return findings


def _check_flow(findings: _Findings, tol: float, stages: _Stages, progress: bool) -> None:
    """Convergence and the Lyapunov checks along the trajectories (when the solve saved more than one time)."""
    solution = findings.solution
    stages.start("convergence")
    findings.convergence = analyze_convergence(solution, tol=tol) if len(solution.ts) > 1 else None
    stages.bar.update()
    stages.start("Lyapunov check")
    findings.lyapunov = check_lyapunov(solution, progress=progress) if len(solution.ts) > 1 else None
    stages.bar.update()


def _study_fixed_points(
    findings: _Findings,
    et_field: ETField,
    states: Tensor,
    fixed_point_tol: float,
    basin_radii: list[float] | None,
    basin_trials: int,
    stages: _Stages,
    progress: bool,
) -> None:
    """The critical point reached from each final state, its stability, the Lyapunov exponents of the trajectories
    and at the point, and the basin probe."""
    final = findings.solution.x.detach()
    stages.start("fixed point")
    fixed = findings.fixed = find_fixed_point(et_field, final, tol=fixed_point_tol)
    stages.bar.update()
    stages.start("stability")
    findings.stability = fixed_point_stability(et_field, fixed.x)
    findings.final_stability = fixed_point_stability(et_field, final)
    stages.bar.update()
    stages.start("Lyapunov exponent")
    span = float(findings.solution.ts[-1] - findings.solution.ts[0]) or 1.0
    # the pair's separation d0 = 1e-6 must stay far above the solve's error rtol |x|: on the spheres the tokens' scale
    # is set, in a Euclidean chart it is the state's own
    spheres = et_field.model.neuron.geometry == "spheres"
    rtol, atol = (1e-8, 1e-10) if spheres else (1e-12, 1e-14)
    solver = Adaptive("dopri5", rtol=rtol, atol=atol)
    findings.exponent = lyapunov_exponent(
        et_field, states, benettin=Benettin(t1=span, renormalizations=10, solver=solver), progress=progress
    )
    findings.intrinsic = lyapunov_exponent(
        et_field, fixed.x, benettin=Benettin(t1=20.0, solver=solver), restart=True, progress=progress
    )
    stages.bar.update()
    stages.start("basin probe")
    radii = basin_radii or [0.01, 0.03, 0.1, 0.3, 1.0]
    findings.basin = basin_probe(et_field, fixed.x, radii=radii, trials=basin_trials, t1=10.0, segments=5, progress=progress)
    stages.bar.update()
    neuron = et_field.model.neuron
    with torch.no_grad():
        distance = (neuron(final) - neuron(fixed.x)).square().mean(dim=(-1, -2)).sqrt()
    findings.distance = distance.reshape(-1).tolist()


def _draw(findings: _Findings, et_field: ETField, folder: Path, adaptive: bool, stages: _Stages) -> None:
    """The pictures of the trajectories (and the energy slice through the first fixed point)."""
    stages.start("pictures")
    solution, pictures = findings.solution, findings.pictures
    if solution.xs is not None and len(solution.ts) > 1:
        model = et_field.model
        plot_convergence(solution, path=folder / "convergence.png")
        pictures["convergence"] = "convergence.png"
        if model.dim >= 2:
            plot_trajectories(solution, dense=241 if adaptive else None, path=folder / "trajectories.png")
            pictures["trajectories"] = "trajectories.png"
        if isinstance(model.interactions.get("attention"), EnergyAttention):
            plot_attention(solution, path=folder / "attention.png")
            pictures["attention"] = "attention.png"
        if findings.fixed is not None:
            plot_energy_slice(et_field, findings.fixed.x, trajectories=solution, path=folder / "energy_slice.png")
            pictures["energy_slice"] = "energy_slice.png"
    stages.bar.update()


def _study_landscape(findings: _Findings, states: Tensor, folder: Path, stages: _Stages, progress: bool) -> None:
    """The Hessian along the trajectories and the landscape study of sample 0."""
    stages.start("landscape")
    solution = findings.solution
    if solution.xs is not None and len(solution.ts) > 1:
        findings.trace = hessian_along(solution, max_times=12)
        plot_hessian_along(findings.trace, path=folder / "hessian_along.png")
        findings.pictures["hessian_along"] = "hessian_along.png"
    findings.study = landscape_study(
        flat_field(solution).select(0),
        states.reshape(-1, *states.shape[-2:])[0],
        solution.x.detach().reshape(-1, *states.shape[-2:])[0],
        folder,
        progress=progress,
    )
    findings.pictures.update(findings.study.pictures)
    stages.bar.update()


def _summary(
    model: EnergyModel,
    states: Tensor,
    tau: float,
    integration: Integration,
    points: int,
    findings: _Findings,
    source: str,
    fixed_point_tol: float,
) -> dict[str, Any]:
    """The numbers of ``report.json``."""
    fixed, exponent, intrinsic, basin, trace = (
        findings.fixed,
        findings.exponent,
        findings.intrinsic,
        findings.basin,
        findings.trace,
    )
    return {
        "model": source,
        "config": {**_describe_model(model), "dtype": str(states.dtype).replace("torch.", "")},
        "gamma": _gamma(model),
        "tau": tau,
        "device": str(states.device),
        "initial_states": list(states.shape),
        "solve": {
            "solver": settings_to_dict(integration.solver),
            "t1": integration.t1,
            "points": points,
            "failure": findings.failure,
            **findings.solution.stats.as_dict(),
        },
        "convergence": findings.convergence.as_dict() if findings.convergence else None,
        "lyapunov": findings.lyapunov.as_dict() if findings.lyapunov else None,
        "fixed_point": None
        if fixed is None
        else {
            "tol": fixed_point_tol,
            "iterations": fixed.iterations,
            "converged": fixed.converged,
            "rms_tangent_gradient": fixed.rms_tangent_gradient,
            "energy_start": fixed.energy_start,
            "energy_end": fixed.energy_end,
            "rms_g_distance_from_solve": findings.distance,
        },
        "stability": findings.stability.as_dict() if findings.stability else None,
        "stability_at_final_state": findings.final_stability.as_dict() if findings.final_stability else None,
        "lyapunov_exponent": None
        if exponent is None
        else {"exponent": exponent.exponent, "d0": exponent.d0, "times": exponent.times, "running": exponent.running},
        "basin": None
        if basin is None
        else {"radii": basin.radii, "returned_fraction": basin.returned, "radius": basin.radius, "shrink": basin.shrink},
        "intrinsic_lyapunov_exponent": None
        if intrinsic is None
        else {"exponent": intrinsic.exponent, "late": intrinsic.late},
        "landscape": None if findings.study is None else findings.study.as_dict(),
        "hessian_along": None
        if trace is None
        else {"ts": trace.ts, "smallest": trace.smallest, "largest": trace.largest, "index": trace.index},
        "pictures": findings.pictures,
    }


def _yes(flag: bool) -> str:
    return "**yes**" if flag else "**no**"


def _markdown(summary: dict[str, Any], findings: _Findings) -> str:
    """``report.md``: the set-up, the answers, a section per check, the pictures and the timings."""
    lines = _heading(summary) + ["## Answers", ""] + _answers(summary, findings) + [""]
    lines += _convergence_section(findings) + _lyapunov_section(findings)
    lines += _stability_section(findings) + _basin_section(findings)
    for key, caption in (("trajectories", "Token trajectories (sample 0)"), ("attention", "Attention maps (sample 0)")):
        if key in findings.pictures:
            lines += [f"## {caption}", "", f"![{caption}]({findings.pictures[key]})", ""]
    lines += ["## Timings", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in summary["timings_s"].items()]
    lines += [f"| total | {summary['total_time_s']:.2f} |", ""]
    markdown = "\n".join(lines)
    if findings.trace is not None:
        markdown += (
            "\n## The Hessian along the trajectories\n\nThe Riemannian Hessian's extreme eigenvalues and "
            "its index (negative eigenvalues) at saved states: where a trajectory passes near a saddle, the "
            "index is positive.\n\n![Hessian spectrum along the trajectories](hessian_along.png)\n"
        )
    if findings.study is not None:
        markdown += "\n" + findings.study.markdown()
    return markdown


def _describe(summary: dict[str, Any]) -> str:
    """The model in words: the ET's sizes, or a model's neuron and interactions."""
    config, gamma = summary["config"], summary["gamma"]
    if config["model"] == "EnergyTransformer":
        return (
            f"D = {config['dim']}, H = {config['heads']}, Y = {config['head_dim']}, K = {config['memories']} "
            f"({config['hopfield']} memories), gamma = {gamma:.4g}, eps = {config['eps']:.2g}"
        )
    return (
        f"an {config['model']} of the {config['neuron']} neuron (D = {config['dim']}) and the interactions "
        + ", ".join(f"{name} ({kind})" for name, kind in config["interactions"].items())
        + (f", gamma = {gamma:.4g}" if gamma is not None else "")
    )


def _heading(summary: dict[str, Any]) -> list[str]:
    solve_info, config = summary["solve"], summary["config"]
    lines = [
        "# ET dynamics report" if config["model"] == "EnergyTransformer" else "# Energy dynamics report",
        "",
        f"Model: {summary['model']}; {_describe(summary)}, {config['dtype']}. Initial states: "
        f"{summary['initial_states'][0]} sample(s) of "
        f"{summary['initial_states'][1]} tokens. Solve: {_solver_text(solve_info['solver'])} to "
        f"t = {solve_info['t_final']:.4g}, tau = {summary['tau']:.3g}: "
        f"{solve_info['nfe_forward']} field evaluations, {solve_info['accepted_steps']} accepted / "
        f"{solve_info['rejected_steps']} rejected steps, status {solve_info['status']}.",
        "",
    ]
    if solve_info["failure"]:
        lines += [f"**The solve failed**: {solve_info['failure']}. The checks below use the partial trajectory.", ""]
    return lines


def _answers(summary: dict[str, Any], findings: _Findings) -> list[str]:
    """The answers in a sentence each: convergence, the Lyapunov function, the kind of attractor, the exponents and
    the basin."""
    batch = summary["initial_states"][0]
    spheres = summary["gamma"] is not None  # the LayerNorm neuron (else a neuron of Euclidean geometry)
    lines = []
    convergence, lyapunov = findings.convergence, findings.lyapunov
    if convergence is not None:
        converged = sum(s.converged for s in convergence.samples)
        critical = sum(s.tangent_converged for s in convergence.samples)
        better = {s.better_fit for s in convergence.samples}
        lines.append(
            f"- **Did it converge?** RMS |dg/dt| < {convergence.tol:g} by the end: {converged} of {batch} "
            f"sample(s). Intrinsically (RMS |{'T dE/dg' if spheres else 'dE/dg'}| < {convergence.tangent_tol:g}, "
            f"the distance from a critical point{' on the spheres' if spheres else ''}): {critical} of {batch}. "
            f"The decay of |dg/dt| near the end is fitted better by: {', '.join(sorted(better))}."
        )
    if lyapunov is not None:
        lines.append(
            f"- **Is the energy a Lyapunov function here?** Energy never rose and dE/dt <= 0 with M PSD: "
            f"{_yes(all(lyapunov.descends))} ({sum(lyapunov.descends)} of {batch}); measured energy "
            f"changes match the exact dE/dt = -(1/tau) sum (dE/dg)^T M (dE/dg): "
            f"{_yes(all(lyapunov.follows_rate))} ({sum(lyapunov.follows_rate)} of {batch})."
        )
    return lines + _attractor_answers(summary, findings)


def _attractor_answers(summary: dict[str, Any], findings: _Findings) -> list[str]:
    spheres = summary["gamma"] is not None  # the LayerNorm neuron (else a neuron of Euclidean geometry)
    lines = []
    if findings.stability is not None:
        kinds = [s.kind for s in findings.stability.samples]
        lines.append(
            "- **What kind of attractor?** At the critical point reached from each final state: "
            + ", ".join(f"sample {b}: {k}" for b, k in enumerate(kinds))
            + f" ({'Riemannian Hessian' if spheres else 'Hessian of E(g(x))'}, {findings.stability.method})."
        )
    elif spheres and summary["gamma"] <= 0:
        lines.append(
            "- **What kind of attractor?** Not analysed: gamma <= 0, so the energy is not a Lyapunov "
            "function and the dynamics need not settle."
        )
    if findings.exponent is not None:
        transient = (
            "This measures the transient, not the attractor: along the plain flow the token scales grow "
            "like t, so every rate decays like 1/t and the exponent tends to 0 from either side; a small "
            "positive value says nearby trajectories separated for a while on the way (before the basin "
            "was reached), not that the attractor is unstable."
            if spheres
            else "It averages the transient and the approach to the attractor."
        )
        lines.append(
            "- **Finite-time Lyapunov exponent** of the trajectories (growth rate of a small perturbation "
            f"of {'g' if spheres else 'x'}, per unit time): "
            + ", ".join(f"{v:.3g}" for v in findings.exponent.exponent.tolist())
            + ". "
            + transient
        )
    if findings.intrinsic is not None:
        lines.append(
            "- **Lyapunov exponent at the critical point, in intrinsic time** ("
            + (
                "the token scales held fixed, where the rates do not decay"
                if spheres
                else "the plain flow, whose rates do not decay"
            )
            + "; over the second half of 20 time units): "
            + ", ".join(f"{v:.4g}" for v in findings.intrinsic.late.tolist())
            + " (negative: perturbations decay; at a minimum it is "
            + ("-(gamma / tau) lambda_min of Hess_R)." if spheres else "-(1 / tau) lambda_min of M^(1/2) H M^(1/2)).")
        )
    if findings.basin is not None:
        lines.append(
            f"- **Basin probe**: perturbations of {'g (RMS per element / gamma)' if spheres else 'x (RMS per element)'} "
            "return up to radius " + ", ".join(f"{r:g}" for r in findings.basin.radius) + " (per sample)."
        )
    return lines


def _convergence_section(findings: _Findings) -> list[str]:
    convergence = findings.convergence
    if convergence is None:
        return []
    spheres = findings.solution.field.model.neuron.geometry == "spheres"
    measured = (
        "Convergence is measured on g, not x: x drifts along each token's all-ones vector and radially "
        "(its scale sigma grows about linearly in t), which leaves g unchanged but slows the motion of g "
        "down like 1/sigma. So RMS |dg/dt| falls like a power of t even while g is still far from a "
        "critical point; RMS |T dE/dg| is the scale-free distance."
        if spheres
        else "Convergence is measured on g = neuron(x) (dg/dt) and on the gradient dE/dg, which vanishes exactly at a "
        "critical point."
    )
    lines = _section(
        "Convergence",
        f"{measured} Decay fits use the last {100 * convergence.tail:.0f}% of the time span.",
        convergence.table(),
    )
    if "convergence" in findings.pictures:
        lines += [f"![Energy, |dg/dt|, |T dE/dg| and drifts against time]({findings.pictures['convergence']})", ""]
    return lines


def _section(title: str, *blocks: str) -> list[str]:
    """The lines of a Markdown section: the heading ``title``, then each block (a paragraph, a table), each followed
    by a blank line."""
    lines = [f"## {title}", ""]
    for block in blocks:
        lines += [block, ""]
    return lines


def _lyapunov_section(findings: _Findings) -> list[str]:
    if findings.lyapunov is None:
        return []
    return _section(
        "Lyapunov checks",
        "Energy rises beyond rounding, positive exact dE/dt, a metric M that is not positive semi-definite "
        "(gamma <= 0), and energy changes that do not match the integral of the exact dE/dt (trapezoid, "
        "then a dense re-integration where the trapezoid disagrees) are listed with their times.",
        findings.lyapunov.table(),
    )


def _stability_section(findings: _Findings) -> list[str]:
    fixed, stability, final_stability = findings.fixed, findings.stability, findings.final_stability
    if fixed is None or stability is None or final_stability is None or findings.distance is None:
        return []
    spheres = findings.solution.field.model.neuron.geometry == "spheres"
    search = (
        "A plain solve approaches its limit only like a power of t, so the critical point is found by "
        "Riemannian gradient descent on the spheres"
        if spheres
        else "The critical point is found by gradient descent in x"
    )
    lines = _section(
        "Stability",
        f"{search} from each final state ({fixed.iterations} iterations, "
        f"RMS |{'T dE/dg' if spheres else 'dE/dg'}| reached: "
        f"{', '.join(f'{v:.2g}' for v in fixed.rms_tangent_gradient.tolist())}; RMS "
        f"distance in g from the solver's final state: {', '.join(f'{v:.3g}' for v in findings.distance)}).",
        stability.table(),
        "For comparison, the same spectrum at the solver's final states (not critical points: the "
        "classification there describes the local curvature only):",
        final_stability.table(),
    )
    if "energy_slice" in findings.pictures:
        lines += [f"![Energy slice through the fixed point of sample 0]({findings.pictures['energy_slice']})", ""]
    return lines


def _basin_section(findings: _Findings) -> list[str]:
    basin = findings.basin
    if basin is None:
        return []
    lines = [
        "## Basin probe",
        "",
        f"Random tangent perturbations of each fixed point, followed for 10 time units (with scale "
        f"restarts); a trial returns when its final distance is at most {basin.shrink:g} of the initial one.",
        "",
        "| sample | " + " | ".join(f"r = {r:g}" for r in basin.radii) + " | basin radius |",
        "|---|" + "---|" * (len(basin.radii) + 1),
    ]
    for b, radius in enumerate(basin.radius):
        fractions = " | ".join(f"{100 * v:.0f}%" for v in basin.returned[b].tolist())
        lines.append(f"| {b} | {fractions} | {radius:g} |")
    return lines + [""]
