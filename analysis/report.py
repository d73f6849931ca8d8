"""One call that solves a model and runs every check, writing a readable report.

``analyze(...)`` writes into a folder: ``report.md`` (read top to bottom: did it converge, is the energy
a Lyapunov function here, what kind of attractor), ``report.json`` (the same numbers, machine-readable)
and the PNGs it embeds. The ``et-ode analyze`` subcommand (:mod:`et_ode.cli.analyze`) is its command-line face.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from et_ode import EnergyTransformer, ETField, SolveError, solve
from et_ode.analysis.basin_probes import BasinProbe, basin_probe
from et_ode.analysis.convergence import ConvergenceReport, analyze_convergence, flat_field, sample_field
from et_ode.analysis.exponents import LyapunovExponent, lyapunov_exponent
from et_ode.analysis.landscape import landscape_study
from et_ode.analysis.lyapunov import LyapunovReport, check_lyapunov
from et_ode.analysis.plots import plot_attention, plot_convergence, plot_energy_slice, plot_trajectories
from et_ode.analysis.spectra import hessian_along, plot_hessian_along
from et_ode.analysis.stability import FixedPointSearch, StabilityReport, find_fixed_point, fixed_point_stability
from et_ode.integrators.solvers import Adaptive, EulerET, Solver, as_solver
from et_ode.solving.integration import settings_to_dict
from et_ode.training.io import model_config

PathLike = str | os.PathLike[str]
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def random_model(
    seed: int = 0,
    *,
    dim: int = 16,
    heads: int = 2,
    head_dim: int = 8,
    memories: int = 32,
    hopfield: str = "relu",
    dtype: torch.dtype = torch.float64,
) -> EnergyTransformer:
    """The built-in random model: default initialisation from ``seed``, a random ``delta`` (std 0.3)."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = EnergyTransformer(dim, heads, head_dim, memories, hopfield=hopfield).to(dtype)
        with torch.no_grad():
            model.neuron.delta.normal_(0.0, 0.3)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def _resolve_model(
    model: EnergyTransformer | PathLike | None, seed: int, size: dict[str, int], hopfield: str, dtype: torch.dtype
) -> tuple[EnergyTransformer, str]:
    if model is None:
        return random_model(seed, hopfield=hopfield, dtype=dtype, **size), f"random (seed {seed})"
    if isinstance(model, EnergyTransformer):
        return model, "given EnergyTransformer"
    if isinstance(model, (str, os.PathLike)):
        from et_ode.training.io import load_model

        loaded, _ = load_model(model)
        return loaded.to(dtype), f"loaded from {model}"
    raise TypeError(
        f"model must be an EnergyTransformer, a path written by et_ode.training.io.save_model or None, "
        f"got {type(model).__name__}"
    )


def _resolve_states(x0: Tensor | PathLike | None, model: EnergyTransformer, seed: int, batch: int, tokens: int) -> Tensor:
    dtype = model.neuron.delta.dtype
    if x0 is None:
        generator = torch.Generator().manual_seed(seed + 1)
        return torch.randn(batch, tokens, model.dim, generator=generator, dtype=dtype)
    if isinstance(x0, (str, os.PathLike)):
        path = Path(x0)
        if not path.is_file():
            raise FileNotFoundError(f"x0: no file at {path.resolve()} (expected a torch-saved tensor (batch, N, D))")
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ValueError(f"x0: {path} is not a readable torch-saved tensor: {error}") from error
        x0 = loaded
    if not isinstance(x0, Tensor):
        raise TypeError(f"x0 must be a tensor (batch, N, D), a path to one, or None; got {type(x0).__name__}")
    if x0.dim() == 2:
        x0 = x0[None]
    if x0.dim() != 3 or x0.shape[-1] != model.dim:
        raise ValueError(f"x0 must have shape (batch, N, D) with D={model.dim}, got {tuple(x0.shape)}")
    return x0.to(dtype)


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


ANALYZE_SOLVER = Adaptive(rtol=1e-6, atol=1e-8)


def _solver_text(solver: dict[str, Any]) -> str:
    """``dopri5 (rtol 1e-06, atol 1e-08)`` from a solver's plain data (``settings_to_dict``)."""
    settings = ", ".join(
        f"{name} {value:.3g}" if isinstance(value, float) else f"{name} {value}"
        for name, value in solver.items()
        if name not in ("kind", "method", "options")
    )
    return f"{solver['kind']} {solver.get('method', '')}".rstrip() + (f" ({settings})" if settings else "")


def analyze(
    model: EnergyTransformer | PathLike | None = None,
    x0: Tensor | PathLike | None = None,
    *,
    out: PathLike = "runs/analyze",
    seed: int = 0,
    dim: int = 16,
    heads: int = 2,
    head_dim: int = 8,
    memories: int = 32,
    hopfield: str = "relu",
    tokens: int = 8,
    batch: int = 3,
    dtype: str = "float64",
    tau: float = 1.0,
    solver: Solver | str = ANALYZE_SOLVER,
    t_end: float = 30.0,
    points: int = 61,
    tol: float = 1e-3,
    fixed_point_tol: float = 1e-7,
    basin_radii: list[float] | None = None,
    basin_trials: int = 3,
    landscape: bool = False,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> Path:
    """Solve, check and picture one model; return the folder holding ``report.md``, ``report.json`` and PNGs.

    Args:
        model: an EnergyTransformer, a path written by ``et_ode.training.io.save_model``, or None for the built-in
            random model (``seed``, ``dim``, ``heads``, ``head_dim``, ``memories``, ``hopfield``).
        x0: initial states ``(batch, N, D)``, a path to a torch-saved tensor, or None for ``batch`` random
            samples of ``tokens`` tokens (seeded by ``seed``).
        out: the folder to write (created; files in it are overwritten).
        dtype: ``"float64"`` (default, for tight checks) or ``"float32"``.
        tau, solver: the solve: the field's time constant and an :class:`et_ode.Adaptive`, :class:`et_ode.Fixed` or
            :class:`et_ode.EulerET` (the paper's scheme), or a method's name (default ``Adaptive(rtol=1e-6,
            atol=1e-8)``).
        t_end, points: the time span and the number of saved times (ignored by :class:`et_ode.EulerET`).
        tol: convergence tolerance on RMS ``|dg/dt|`` (and on RMS ``|T dE/dg|``).
        fixed_point_tol: RMS ``|T dE/dg|`` at which the fixed-point search stops.
        basin_radii, basin_trials: the basin probe (default radii 0.01 ... 1).
        landscape: add the landscape study of sample 0 (:func:`~et_ode.analysis.landscape.landscape_study`:
            critical points of any index, saddle connections, basins, asymptotic rate, Lyapunov spectrum,
            continuation) and the Hessian's spectrum along every trajectory. Dense Hessians of dimension
            ``N (D - 2)``: meant for small models (seconds for ``N (D - 2)`` about 12, minutes for 112).
        device: where to compute (default: CUDA when available, else CPU).
        progress: show tqdm progress bars.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    solver = as_solver(solver)
    if not (t_end > 0 and isinstance(points, int) and points >= 3):
        raise ValueError(f"t_end must be positive and points an integer >= 3, got t_end={t_end}, points={points}")
    started = time.perf_counter()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    size = {"dim": dim, "heads": heads, "head_dim": head_dim, "memories": memories}
    et_model, origin = _resolve_model(model, seed, size, hopfield, DTYPES[dtype])
    states = _resolve_states(x0, et_model, seed, batch, tokens)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    et_model, states = et_model.to(device), states.to(device)
    field = ETField(et_model, tau=tau)
    stages = [
        "solve",
        "convergence",
        "Lyapunov check",
        "fixed point",
        "stability",
        "Lyapunov exponent",
        "basin probe",
        "pictures",
    ] + (["landscape"] if landscape else [])
    bar = tqdm(stages, desc="analyze", disable=not progress)
    timings: dict[str, float] = {}

    def stage(name: str) -> None:
        timings[name] = time.perf_counter()
        bar.set_description(f"analyze: {name}")

    stage("solve")
    failure = None
    grid = None if isinstance(solver, EulerET) else torch.linspace(0.0, t_end, points, dtype=torch.float64)
    try:
        solution = solve(field, states, grid, solver=solver, max_steps=100_000)
    except SolveError as error:
        if error.solution is None:
            raise
        failure, solution = str(error), error.solution
    bar.update()
    stage("convergence")
    convergence = analyze_convergence(solution, tol=tol) if len(solution.ts) > 1 else None
    bar.update()
    stage("Lyapunov check")
    lyapunov = check_lyapunov(solution, progress=progress) if len(solution.ts) > 1 else None
    bar.update()
    gamma = float(et_model.neuron.gamma.detach())
    fixed = stability = final_stability = exponent = intrinsic = basin = None
    if gamma > 0:
        stage("fixed point")
        fixed = find_fixed_point(field, solution.x.detach(), tol=fixed_point_tol)
        bar.update()
        stage("stability")
        stability = fixed_point_stability(field, fixed.x)
        final_stability = fixed_point_stability(field, solution.x.detach())
        bar.update()
        stage("Lyapunov exponent")
        exponent = lyapunov_exponent(
            field,
            states,
            duration=float(solution.ts[-1] - solution.ts[0]) or 1.0,
            renormalizations=10,
            rtol=1e-8,
            atol=1e-10,
            progress=progress,
        )
        intrinsic = lyapunov_exponent(
            field, fixed.x, duration=20.0, renormalizations=20, restart=True, rtol=1e-8, atol=1e-10, progress=progress
        )
        bar.update()
        stage("basin probe")
        basin = basin_probe(
            field,
            fixed.x,
            radii=basin_radii or [0.01, 0.03, 0.1, 0.3, 1.0],
            trials=basin_trials,
            duration=10.0,
            segments=5,
            progress=progress,
        )
        bar.update()
    else:
        bar.update(4)
    stage("pictures")
    pictures: dict[str, str] = {}
    if solution.xs is not None and len(solution.ts) > 1:
        plot_convergence(solution, path=folder / "convergence.png")
        plot_trajectories(solution, dense=241 if solver.adaptive else None, path=folder / "trajectories.png")
        plot_attention(solution, path=folder / "attention.png")
        pictures.update(convergence="convergence.png", trajectories="trajectories.png", attention="attention.png")
        if fixed is not None:
            plot_energy_slice(field, fixed.x, trajectories=solution, path=folder / "energy_slice.png")
            pictures["energy_slice"] = "energy_slice.png"
    bar.update()
    study = trace = None
    if landscape and gamma > 0:
        stage("landscape")
        if solution.xs is not None and len(solution.ts) > 1:
            trace = hessian_along(solution, max_times=12)
            plot_hessian_along(trace, path=folder / "hessian_along.png")
            pictures["hessian_along"] = "hessian_along.png"
        study = landscape_study(
            sample_field(flat_field(solution), 0),
            states.reshape(-1, *states.shape[-2:])[0],
            solution.x.detach().reshape(-1, *states.shape[-2:])[0],
            folder=folder,
            progress=progress,
        )
        pictures.update(study.pictures)
        bar.update()
    bar.close()
    ends = list(timings.values())[1:] + [time.perf_counter()]
    timings = {name: end - begin for (name, begin), end in zip(timings.items(), ends, strict=True)}

    with torch.no_grad():
        distance = None
        if fixed is not None:
            distance = (
                (et_model.neuron(solution.x.detach()) - et_model.neuron(fixed.x))
                .square()
                .mean(dim=(-1, -2))
                .sqrt()
                .reshape(-1)
                .tolist()
            )
    config = {**model_config(et_model), "dtype": str(et_model.neuron.delta.dtype).replace("torch.", "")}
    summary = {
        "model": origin,
        "config": config,
        "gamma": gamma,
        "tau": tau,
        "device": str(device),
        "initial_states": list(states.shape),
        "solve": {
            "solver": settings_to_dict(solver),
            "t_end": t_end,
            "points": points,
            "failure": failure,
            **solution.stats.as_dict(),
        },
        "convergence": convergence.as_dict() if convergence else None,
        "lyapunov": lyapunov.as_dict() if lyapunov else None,
        "fixed_point": None
        if fixed is None
        else {
            "tol": fixed_point_tol,
            "iterations": fixed.iterations,
            "converged": fixed.converged,
            "rms_tangent_gradient": fixed.rms_tangent_gradient,
            "energy_start": fixed.energy_start,
            "energy_end": fixed.energy_end,
            "rms_g_distance_from_solve": distance,
        },
        "stability": stability.as_dict() if stability else None,
        "stability_at_final_state": final_stability.as_dict() if final_stability else None,
        "lyapunov_exponent": None
        if exponent is None
        else {"exponent": exponent.exponent, "d0": exponent.d0, "times": exponent.times, "running": exponent.running},
        "basin": None
        if basin is None
        else {"radii": basin.radii, "returned_fraction": basin.returned, "radius": basin.radius, "shrink": basin.shrink},
        "intrinsic_lyapunov_exponent": None
        if intrinsic is None
        else {"exponent": intrinsic.exponent, "late": intrinsic.late},
        "landscape": None if study is None else study.as_dict(),
        "hessian_along": None
        if trace is None
        else {"ts": trace.ts, "smallest": trace.smallest, "largest": trace.largest, "index": trace.index},
        "pictures": pictures,
        "timings_s": timings,
        "total_time_s": time.perf_counter() - started,
    }
    (folder / "report.json").write_text(json.dumps(_clean(summary), indent=2))
    markdown = _markdown(
        summary, convergence, lyapunov, stability, final_stability, exponent, basin, fixed, distance, pictures, intrinsic
    )
    if trace is not None:
        markdown += (
            "\n## The Hessian along the trajectories\n\nThe Riemannian Hessian's extreme eigenvalues and "
            "its index (negative eigenvalues) at saved states: where a trajectory passes near a saddle, the "
            "index is positive.\n\n![Hessian spectrum along the trajectories](hessian_along.png)\n"
        )
    if study is not None:
        markdown += "\n" + study.markdown()
    (folder / "report.md").write_text(markdown)
    return folder


def _yes(flag: bool) -> str:
    return "**yes**" if flag else "**no**"


def _markdown(
    summary: dict,
    convergence: ConvergenceReport | None,
    lyapunov: LyapunovReport | None,
    stability: StabilityReport | None,
    final_stability: StabilityReport | None,
    exponent: LyapunovExponent | None,
    basin: BasinProbe | None,
    fixed: FixedPointSearch | None,
    distance: list[float] | None,
    pictures: dict[str, str],
    intrinsic: LyapunovExponent | None = None,
) -> str:
    solve_info, config = summary["solve"], summary["config"]
    batch = summary["initial_states"][0]
    lines = [
        "# ET dynamics report",
        "",
        f"Model: {summary['model']}; D = {config['dim']}, H = {config['heads']}, Y = {config['head_dim']}, "
        f"K = {config['memories']} ({config['hopfield']} memories), gamma = {summary['gamma']:.4g}, "
        f"eps = {config['eps']:.2g}, {config['dtype']}. Initial states: {batch} sample(s) of "
        f"{summary['initial_states'][1]} tokens. Solve: {_solver_text(solve_info['solver'])} to "
        f"t = {solve_info['t_final']:.4g}, tau = {summary['tau']:.3g}: "
        f"{solve_info['nfe_forward']} field evaluations, {solve_info['accepted_steps']} accepted / "
        f"{solve_info['rejected_steps']} rejected steps, status {solve_info['status']}.",
        "",
    ]
    if solve_info["failure"]:
        lines += [f"**The solve failed**: {solve_info['failure']}. The checks below use the partial trajectory.", ""]
    lines += ["## Answers", ""]
    if convergence is not None:
        converged = sum(s.converged for s in convergence.samples)
        critical = sum(s.tangent_converged for s in convergence.samples)
        better = {s.better_fit for s in convergence.samples}
        lines.append(
            f"- **Did it converge?** RMS |dg/dt| < {convergence.tol:g} by the end: {converged} of {batch} "
            f"sample(s). Intrinsically (RMS |T dE/dg| < {convergence.tangent_tol:g}, the distance from a "
            f"critical point on the spheres): {critical} of {batch}. The decay of |dg/dt| near the end is "
            f"fitted better by: {', '.join(sorted(better))}."
        )
    if lyapunov is not None:
        lines.append(
            f"- **Is the energy a Lyapunov function here?** Energy never rose and dE/dt <= 0 with M PSD: "
            f"{_yes(all(lyapunov.descends))} ({sum(lyapunov.descends)} of {batch}); measured energy "
            f"changes match the exact dE/dt = -(1/tau) sum (dE/dg)^T M (dE/dg): "
            f"{_yes(all(lyapunov.follows_rate))} ({sum(lyapunov.follows_rate)} of {batch})."
        )
    if stability is not None:
        kinds = [s.kind for s in stability.samples]
        lines.append(
            "- **What kind of attractor?** At the critical point reached from each final state: "
            + ", ".join(f"sample {b}: {k}" for b, k in enumerate(kinds))
            + f" (Riemannian Hessian, {stability.method})."
        )
    elif summary["gamma"] <= 0:
        lines.append(
            "- **What kind of attractor?** Not analysed: gamma <= 0, so the energy is not a Lyapunov "
            "function and the dynamics need not settle."
        )
    if exponent is not None:
        lines.append(
            "- **Finite-time Lyapunov exponent** of the trajectories (growth rate of a small perturbation "
            "of g, per unit time): " + ", ".join(f"{v:.3g}" for v in exponent.exponent.tolist()) + ". "
            "This measures the transient, not the attractor: along the plain flow the token scales grow "
            "like t, so every rate decays like 1/t and the exponent tends to 0 from either side; a small "
            "positive value says nearby trajectories separated for a while on the way (before the basin "
            "was reached), not that the attractor is unstable."
        )
    if intrinsic is not None:
        lines.append(
            "- **Lyapunov exponent at the critical point, in intrinsic time** (the token scales held "
            "fixed, where the rates do not decay; over the second half of 20 time units): "
            + ", ".join(f"{v:.4g}" for v in intrinsic.late.tolist())
            + " (negative: perturbations decay; at a minimum it is -(gamma / tau) lambda_min of Hess_R)."
        )
    if basin is not None:
        lines.append(
            "- **Basin probe**: perturbations of g (RMS per element / gamma) return up to radius "
            + ", ".join(f"{r:g}" for r in basin.radius)
            + " (per sample)."
        )
    lines.append("")
    if convergence is not None:
        lines += [
            "## Convergence",
            "",
            "Convergence is measured on g, not x: x drifts along each token's all-ones vector and radially "
            "(its scale sigma grows about linearly in t), which leaves g unchanged but slows the motion of g "
            "down like 1/sigma. So RMS |dg/dt| falls like a power of t even while g is still far from a "
            "critical point; RMS |T dE/dg| is the scale-free distance. Decay fits use the last "
            f"{100 * convergence.tail:.0f}% of the time span.",
            "",
            convergence.table(),
            "",
        ]
        if "convergence" in pictures:
            lines += [f"![Energy, |dg/dt|, |T dE/dg| and drifts against time]({pictures['convergence']})", ""]
    if lyapunov is not None:
        lines += [
            "## Lyapunov checks",
            "",
            "Energy rises beyond rounding, positive exact dE/dt, a metric M that is not positive semi-definite "
            "(gamma <= 0), and energy changes that do not match the integral of the exact dE/dt (trapezoid, "
            "then a dense re-integration where the trapezoid disagrees) are listed with their times.",
            "",
            lyapunov.table(),
            "",
        ]
    if stability is not None and final_stability is not None and fixed is not None and distance is not None:  # together
        lines += [
            "## Stability",
            "",
            f"A plain solve approaches its limit only like a power of t, so the critical point is found by "
            f"Riemannian gradient descent on the spheres from each final state ({fixed.iterations} iterations, "
            f"RMS |T dE/dg| reached: {', '.join(f'{v:.2g}' for v in fixed.rms_tangent_gradient.tolist())}; RMS "
            f"distance in g from the solver's final state: {', '.join(f'{v:.3g}' for v in distance)}).",
            "",
            stability.table(),
            "",
            "For comparison, the same spectrum at the solver's final states (not critical points: the "
            "classification there describes the local curvature only):",
            "",
            final_stability.table(),
            "",
        ]
        if "energy_slice" in pictures:
            lines += [f"![Energy slice through the fixed point of sample 0]({pictures['energy_slice']})", ""]
    if basin is not None:
        lines += [
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
        lines.append("")
    for key, caption in (("trajectories", "Token trajectories (sample 0)"), ("attention", "Attention maps (sample 0)")):
        if key in pictures:
            lines += [f"## {caption}", "", f"![{caption}]({pictures[key]})", ""]
    lines += ["## Timings", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in summary["timings_s"].items()]
    lines += [f"| total | {summary['total_time_s']:.2f} |", ""]
    return "\n".join(lines)
