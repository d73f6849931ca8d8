"""A landscape study of one sample, for ``et-ode analyze``: critical points, saddle connections, basins,
the asymptotic rate, the Lyapunov spectrum at the attractor and a continuation, with pictures.

:func:`landscape_study` runs the tools of :mod:`~et_ode.analysis.critical_points`,
:mod:`~et_ode.analysis.connections`, :mod:`~et_ode.analysis.basins`, :mod:`~et_ode.analysis.asymptotics`,
:mod:`~et_ode.analysis.spectra` and :mod:`~et_ode.analysis.continuation` on one sample (``(N, D)`` states) and
returns a :class:`LandscapeStudy` whose ``markdown()`` is a report section. Dense Hessians of dimension
``N (D - 2)`` are formed, so this is meant for small ``N D`` (the default random model: 112).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from et_ode import ETField, HopfieldMemory
from et_ode.analysis.asymptotics import MeasuredRate, measured_exponent, plot_asymptotics
from et_ode.analysis.basins import AttractorCensus, BasinMap, attractor_census, basin_map, plot_basin_map
from et_ode.analysis.chart import chart_for
from et_ode.analysis.connections import Network, plot_disconnectivity, saddle_network
from et_ode.analysis.continuation import ArcLength, Branch, continue_branch, plot_bifurcation_diagram
from et_ode.analysis.critical_points import (
    Census,
    CriticalPoint,
    census,
    deduplicate,
    newton_critical_point,
    saddle_from_minimum,
)
from et_ode.analysis.exponents import Benettin
from et_ode.analysis.spectra import LyapunovSpectrum, lyapunov_spectrum

PathLike = str | os.PathLike[str]


@dataclass
class LandscapeStudy:
    """Everything :func:`landscape_study` found (``None`` where a step did not apply), and notes on the steps skipped.

    Attributes:
        census: the critical points from the final state and random states.
        network: the index-1 saddles and the minima they join, or None without a saddle or minimum.
        basins: the basin map on the plane of a saddle and the two minima it joins, or None.
        attractors: the attractors reached from random starts.
        asymptotics: the measured power law of the approach to the limit, or None where it does not apply.
        spectrum: the Lyapunov spectrum at the solve's limit ``(k,)``, or None where the limit is not a minimum.
        spectrum_expected: the spectrum the Hessian predicts there ``(k,)``, or None.
        branch: the continuation of the limit in the memories' (or weights') scale, or None.
        pictures: the picture files written, by name (relative to the folder).
        notes: the steps skipped, and why.
        spheres: the LayerNorm neuron's geometry (False: a Euclidean neuron's, in ``x``).
        memories: continued in the Hopfield memories' scale (False: in every interaction weight's).
    """

    census: Census
    network: Network | None
    basins: BasinMap | None
    attractors: AttractorCensus
    asymptotics: MeasuredRate | None
    spectrum: LyapunovSpectrum | None
    spectrum_expected: Tensor | None
    branch: Branch | None
    pictures: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    spheres: bool = True  # the LayerNorm neuron's geometry (else a Euclidean neuron's, in x)
    memories: bool = True  # continued in the Hopfield memories' scale (else in every interaction weight's)

    def markdown(self) -> str:
        where = (
            "on the product of spheres, by trust-region Newton on the Riemannian gradient"
            if self.spheres
            else "in x, by trust-region Newton on the gradient of E(g(x))"
        )
        lines = [
            "## The energy landscape of sample 0",
            "",
            f"Critical points of any index {where} from the solve's final state and random states, and by descent "
            "polished by Newton (identified modulo token permutations when there is no mask):",
            "",
            self.census.table(),
            "",
        ]
        if self.network is not None:
            lines += [
                "### Saddles and the minima they connect",
                "",
                "Index-1 saddles from the census and from minimum-mode following out of the lowest minima; from "
                "each, the flow (et_ode.solve) is followed down both branches of the unstable eigenvector. "
                "Barriers are E(saddle) - E(minimum).",
                "",
                self.network.table(),
                "",
            ]
            if "disconnectivity" in self.pictures:
                lines += [f"![Disconnectivity graph]({self.pictures['disconnectivity']})", ""]
        if self.basins is not None:
            lines += [
                "### Basins",
                "",
                "Initial states on the plane through a saddle and the two minima it joins, "
                "coloured by the attractor the ET flow reaches, with the descent direction's streamlines:",
                "",
                f"![Basin map]({self.pictures['basins']})",
                "",
            ]
        lines += ["### Attractors reached from random starts", "", self.attractors.table(), ""]
        if self.asymptotics is not None:
            rate = self.asymptotics
            lines += [
                "### Asymptotic rate",
                "",
                "The token scales grow linearly (sigma_A ~ rho_A t / (tau sqrt D), rho_A the outward force), so "
                "|g - g*| ~ t^(-p) with p = lambda_min(K^(-1/2) Hess_R K^(-1/2)), K = diag(rho_A / r): an "
                "exponential approach in the intrinsic time log t.",
                "",
                f"| predicted p | measured p (fit of RMS |g - g*| over the last {rate.fit.points} saved times, "
                "log-time window) | RMS log residual |",
                "|---|---|---|",
                f"| {rate.predicted.exponent:.4f} | {rate.exponent:.4f} | {rate.fit.rms_log_residual:.2g} |",
                "",
                f"![|g - g*| against log t]({self.pictures['asymptotics']})",
                "",
            ]
        if self.spectrum is not None and self.spectrum_expected is not None:  # set together
            lines += [
                "### Lyapunov spectrum at the attractor",
                "",
                (
                    "QR method on the fixed-scale flow (sigma held at 1: intrinsic time, no restart bias). At a "
                    "minimum the exponents are -(gamma / tau) times the Riemannian Hessian's eigenvalues:"
                    if self.spheres
                    else "QR method on the flow. At a minimum the exponents are -(1 / tau) times the Hessian's eigenvalues:"
                ),
                "",
                f"| exponent (second half) | -({'gamma' if self.spheres else '1'} / tau) lambda |",
                "|---|---|",
            ]
            lines += [
                f"| {float(a):.5g} | {float(b):.5g} |"
                for a, b in zip(self.spectrum.late, self.spectrum_expected, strict=True)
            ]
            lines.append("")
        if self.branch is not None:
            scaled = (
                "the memories xi are scaled by s (E_HN(s xi))"
                if self.memories
                else "every parameter of the interactions is scaled by s"
            )
            lines += [
                f"### Continuation in the {'Hopfield memories' if self.memories else 'interaction weights'}' scale",
                "",
                f"The attractor reached by the solve, continued by pseudo-arclength as {scaled}; zero crossings of "
                "Hessian eigenvalues are classified as folds or branch points.",
                "",
                self.branch.table(),
                "",
                f"![Bifurcation diagram]({self.pictures['bifurcation']})",
                "",
            ]
        if self.notes:
            lines += ["Notes: " + " ".join(self.notes), ""]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        def point(p: CriticalPoint) -> dict[str, Any]:
            return {
                "energy": p.energy,
                "index": p.index,
                "kind": p.kind,
                "smallest": float(p.eigenvalues[0]),
                "largest": float(p.eigenvalues[-1]),
                "rms_tangent_gradient": p.rms_tangent_gradient,
            }

        return {
            "critical_points": [{**point(e.point), "count": e.count} for e in self.census.entries],
            "searches": self.census.starts,
            "failed_searches": self.census.failed,
            "connections": None
            if self.network is None
            else [
                {
                    "saddle_energy": self.network.saddles[c.saddle].energy,
                    "minima": list(c.minima),
                    "minima_energies": [self.network.minima[m].energy if m >= 0 else None for m in c.minima],
                    "barriers": list(c.barriers),
                }
                for c in self.network.connections
            ],
            "attractors": [
                {**point(a), "count": n, "interval": list(i)}
                for a, n, i in zip(
                    self.attractors.attractors, self.attractors.counts, self.attractors.intervals, strict=True
                )
            ],
            "asymptotic_exponent": None
            if self.asymptotics is None
            else {
                "predicted": self.asymptotics.predicted.exponent,
                "measured": self.asymptotics.exponent,
                "rms_log_residual": self.asymptotics.fit.rms_log_residual,
            },
            "lyapunov_spectrum": None
            if self.spectrum is None or self.spectrum_expected is None
            else {"exponents": self.spectrum.late.tolist(), "expected": self.spectrum_expected.tolist()},
            "continuation": None
            if self.branch is None
            else {
                "mu": self.branch.mu.tolist(),
                "energies": self.branch.energies.tolist(),
                "indices": self.branch.indices.tolist(),
                "bifurcations": [{"kind": b.kind, "mu": b.mu} for b in self.branch.bifurcations],
            },
            "pictures": self.pictures,
            "notes": self.notes,
        }


def memory_scale_family(field: ETField) -> Callable[[float], ETField]:
    """``s -> field`` with the Hopfield memories ``xi`` scaled by ``s`` (a one-parameter family for continuation;
    the ET's, whose model has a ``"hopfield"`` interaction)."""
    if not isinstance(field.model.interactions.get("hopfield"), HopfieldMemory):
        raise ValueError(
            f"memory_scale_family needs a HopfieldMemory named 'hopfield'; the model is a {type(field.model).__name__}"
        )

    def family(scale: float) -> ETField:
        model = copy.deepcopy(field.model)
        with torch.no_grad():
            model.get_submodule("hopfield").get_parameter("xi").mul_(scale)
        return ETField(model, tau=field.tau, derivative=field.derivative, mask=field.mask, backend=field.backend)

    return family


def weight_scale_family(field: ETField) -> Callable[[float], ETField]:
    """``s -> field`` with every floating-point parameter of the model's interactions scaled by ``s`` (a
    one-parameter family for continuation, for any energy model)."""

    def family(scale: float) -> ETField:
        model = copy.deepcopy(field.model)
        with torch.no_grad():
            for interaction in model.interactions.values():
                for parameter in interaction.parameters():
                    if parameter.is_floating_point():
                        parameter.mul_(scale)
        return ETField(model, tau=field.tau, derivative=field.derivative, mask=field.mask, backend=field.backend)

    return family


def landscape_study(
    field: ETField,
    x0: Tensor,
    x_final: Tensor,
    folder: PathLike,
    *,
    seed: int = 0,
    progress: bool = False,
    starts: int = 4,
    attractor_starts: int = 16,
    basin_resolution: int = 9,
    asymptotics_t1: float = 1e5,
    continuation_end: float = 0.5,
) -> LandscapeStudy:
    """Study the landscape around one sample.

    Args:
        field: the vector field.
        x0: the sample's initial state ``(N, D)``.
        x_final: the solve's final state ``(N, D)``.
        folder: where the pictures are written.
        seed: the random states.
        progress: show progress bars.
        starts: searches from the final state and ``starts - 1`` random states.
        attractor_starts: random starts for the attractor census.
        basin_resolution: grid points per side of the basin map.
        asymptotics_t1: the end time of the measured power law.
        continuation_end: the scale of the memories (or weights) the continuation from 1 heads for.

    Returns:
        The :class:`LandscapeStudy`.
    """
    folder = Path(folder)
    generator = torch.Generator().manual_seed(seed)
    random = torch.randn(starts - 1 + attractor_starts, *x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
    steps = tqdm(total=6, desc="landscape", disable=not progress, leave=False)
    notes: list[str] = []
    found = census(field, torch.cat([x_final[None].detach(), random[: starts - 1]]))
    steps.update()
    minima = found.points(0)
    saddles = found.points(1)
    for minimum in minima[:2]:
        for direction in (1, -1):
            saddle = saddle_from_minimum(field, minimum.x, direction=direction)
            if saddle.converged and saddle.index == 1:
                saddles.append(saddle)
    saddles = [e.point for e in deduplicate(field, saddles)]
    network = basins = None
    pictures: dict[str, str] = {}
    if saddles and minima:
        network = saddle_network(field, minima, saddles[:4])
        plot_disconnectivity(network, path=folder / "disconnectivity.png")
        pictures["disconnectivity"] = "disconnectivity.png"
        joined = [c for c in network.connections if min(c.minima) >= 0 and c.minima[0] != c.minima[1]]
        if joined:
            c = joined[0]
            through = torch.stack([network.minima[m].x for m in c.minima])
            basins = basin_map(
                field, network.saddles[c.saddle].x, through, resolution=basin_resolution, attractors=list(network.minima)
            )
            marks = {"saddle": network.saddles[c.saddle].x, **{f"m{m}": network.minima[m].x for m in c.minima}}
            plot_basin_map(basins, marks=marks, path=folder / "basins.png")
            pictures["basins"] = "basins.png"
        else:
            notes.append("No saddle joined two distinct minima, so no basin map was drawn.")
    else:
        notes.append("No index-1 saddle was found, so there is no connection network or basin map.")
    steps.update()
    attractors = attractor_census(field, random[starts - 1 :], attractors=list(minima))
    steps.update()
    asymptotics = None
    try:
        asymptotics = measured_exponent(field, x0, t1=asymptotics_t1)
        plot_asymptotics([asymptotics], labels=["sample 0"], path=folder / "asymptotics.png")
        pictures["asymptotics"] = "asymptotics.png"
    except ValueError as error:
        notes.append(f"Asymptotic rate not predicted: {error}.")
    steps.update()
    limit = newton_critical_point(field, x_final.detach())
    spectrum = expected = None
    if limit.converged and limit.index == 0:
        count = min(4, len(limit.eigenvalues))
        rate = chart_for(field).rate()
        if rate is None:
            notes.append("The neuron's rates differ between directions, so the Lyapunov spectrum is not compared.")
        else:
            spectrum = lyapunov_spectrum(field, limit.x, count=count, benettin=Benettin(t1=20.0, renormalizations=40))
            expected = -rate * limit.eigenvalues[:count] / field.tau
    else:
        notes.append(
            "The solve's final state is not near a minimum (Newton did not reach index 0), so the Lyapunov "
            "spectrum was not measured there."
        )
    steps.update()
    branch = None
    if limit.converged:
        memories = isinstance(field.model.interactions.get("hopfield"), HopfieldMemory)
        family = memory_scale_family(field) if memories else weight_scale_family(field)
        try:
            branch = continue_branch(family, limit.x, 1.0, mu_end=continuation_end, arclength=ArcLength(max_points=40))
            plot_bifurcation_diagram(
                [branch],
                labels=["solve's limit"],
                parameter="memory scale s" if memories else "interaction weight scale s",
                path=folder / "bifurcation.png",
            )
            pictures["bifurcation"] = "bifurcation.png"
        except ValueError as error:
            notes.append(f"Continuation failed: {error}.")
    steps.update()
    steps.close()
    if not math.isfinite(found.entries[0].point.energy if found.entries else 0.0):
        notes.append("A critical point with a non-finite energy was found.")
    return LandscapeStudy(
        census=found,
        network=network,
        basins=basins,
        attractors=attractors,
        asymptotics=asymptotics,
        spectrum=spectrum,
        spectrum_expected=expected,
        branch=branch,
        pictures=pictures,
        notes=notes,
        spheres=field.model.neuron.geometry == "spheres",
        memories=isinstance(field.model.interactions.get("hopfield"), HopfieldMemory),
    )
