"""Analysis tools for ET solutions: convergence, Lyapunov checks, stability, pictures, reports.

Installed as ``et_ode.analysis``. Typical use::

    from et_ode.analysis import analyze_convergence, check_lyapunov, find_fixed_point, fixed_point_stability
    report = check_lyapunov(solution)             # print(report) gives a table
    point = find_fixed_point(field, solution.x)
    print(fixed_point_stability(field, point.x))

Critical points of any index (``census``, ``newton_critical_point``, ``saddle_from_minimum``), the saddle
network (``saddle_network``), basins (``basin_map``, ``attractor_census``), the asymptotic exponent
(``predicted_exponent``, ``measured_exponent``), spectra along trajectories (``hessian_along``,
``lyapunov_spectrum``) and continuation (``continue_branch``) work on one state ``(N, D)`` in the chart of the
model's neuron (``chart_for``): on the flow's limit spheres for LayerNorm (radius ``gamma sqrt(D)``, where
:func:`et_ode.find_attractor` places its points), in ``x`` for a Euclidean neuron.

Or everything at once, written to a folder: ``analyze(model, x0, integration, out="runs/analyze")``.
"""

from et_ode.analysis.asymptotics import (
    MeasuredRate,
    PredictedRate,
    RegimeTests,
    measured_exponent,
    plot_asymptotics,
    predicted_exponent,
)
from et_ode.analysis.basin_probes import BasinProbe, basin_probe, flow
from et_ode.analysis.basins import AttractorCensus, BasinMap, attractor_census, basin_map, plot_basin_map, wilson_interval
from et_ode.analysis.chart import Chart, chart_for
from et_ode.analysis.connections import Connection, Network, disconnectivity, plot_disconnectivity, saddle_network
from et_ode.analysis.continuation import ArcLength, Bifurcation, Branch, continue_branch, plot_bifurcation_diagram
from et_ode.analysis.convergence import (
    ConvergenceReport,
    ConvergenceTraces,
    RateFit,
    SampleConvergence,
    analyze_convergence,
    convergence_traces,
    fit_decay,
)
from et_ode.analysis.critical_points import (
    Census,
    CriticalPoint,
    census,
    deduplicate,
    newton_critical_point,
    point_distance,
    saddle_from_minimum,
)
from et_ode.analysis.eigensolvers import dense_eigenvalues, extreme_eigenvalues, power_iteration
from et_ode.analysis.exponents import Benettin, LyapunovExponent, lyapunov_exponent
from et_ode.analysis.landscape import LandscapeStudy, landscape_study
from et_ode.analysis.lyapunov import LyapunovReport, Violation, check_lyapunov, metric_spectrum
from et_ode.analysis.plots import (
    EnergySlice,
    dense_trajectory,
    energy_slice,
    plot_attention,
    plot_convergence,
    plot_energy_slice,
    plot_film_strip,
    plot_trajectories,
)
from et_ode.analysis.report import analyze, random_model, random_states
from et_ode.analysis.spectra import HessianTrace, LyapunovSpectrum, hessian_along, lyapunov_spectrum, plot_hessian_along
from et_ode.analysis.sphere import FixedScaleField, tangent_basis
from et_ode.analysis.stability import (
    FixedPointSearch,
    SampleStability,
    StabilityReport,
    classify,
    find_fixed_point,
    fixed_point_stability,
    g_jacobian,
    operator_stability,
    riemannian_hessian_matrix,
)
from et_ode.linalg.krylov import lanczos

__all__ = [
    "ArcLength",
    "AttractorCensus",
    "BasinMap",
    "BasinProbe",
    "Benettin",
    "Bifurcation",
    "Branch",
    "Census",
    "Chart",
    "Connection",
    "ConvergenceReport",
    "ConvergenceTraces",
    "CriticalPoint",
    "EnergySlice",
    "FixedPointSearch",
    "FixedScaleField",
    "HessianTrace",
    "LandscapeStudy",
    "LyapunovExponent",
    "LyapunovReport",
    "LyapunovSpectrum",
    "MeasuredRate",
    "Network",
    "PredictedRate",
    "RateFit",
    "RegimeTests",
    "SampleConvergence",
    "SampleStability",
    "StabilityReport",
    "Violation",
    "analyze",
    "analyze_convergence",
    "attractor_census",
    "basin_map",
    "basin_probe",
    "census",
    "chart_for",
    "check_lyapunov",
    "classify",
    "continue_branch",
    "convergence_traces",
    "deduplicate",
    "dense_eigenvalues",
    "dense_trajectory",
    "disconnectivity",
    "energy_slice",
    "extreme_eigenvalues",
    "find_fixed_point",
    "fit_decay",
    "fixed_point_stability",
    "flow",
    "g_jacobian",
    "hessian_along",
    "lanczos",
    "landscape_study",
    "lyapunov_exponent",
    "lyapunov_spectrum",
    "measured_exponent",
    "metric_spectrum",
    "newton_critical_point",
    "operator_stability",
    "plot_asymptotics",
    "plot_attention",
    "plot_basin_map",
    "plot_bifurcation_diagram",
    "plot_convergence",
    "plot_disconnectivity",
    "plot_energy_slice",
    "plot_film_strip",
    "plot_hessian_along",
    "plot_trajectories",
    "point_distance",
    "power_iteration",
    "predicted_exponent",
    "random_model",
    "random_states",
    "riemannian_hessian_matrix",
    "saddle_from_minimum",
    "saddle_network",
    "tangent_basis",
    "wilson_interval",
]
