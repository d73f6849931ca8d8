"""Analysis tools for ET solutions: convergence, Lyapunov checks, stability, pictures, reports.

Installed as ``et_ode.analysis``. Typical use::

    from et_ode.analysis import analyze_convergence, check_lyapunov, find_fixed_point, fixed_point_stability
    report = check_lyapunov(solution, field)      # print(report) gives a table
    point = find_fixed_point(field, solution.x)
    print(fixed_point_stability(field, point.x))

or everything at once, written to a folder: ``analyze(model, x0, out="runs/analyze")``.
"""

from .convergence import (
    ConvergenceReport,
    ConvergenceTraces,
    RateFit,
    SampleConvergence,
    analyze_convergence,
    convergence_traces,
    fit_decay,
    tangent_gradient,
)
from .lyapunov import LyapunovReport, Violation, check_lyapunov, metric_spectrum
from .plots import plot_attention, plot_convergence, plot_energy_slice, plot_film_strip, plot_trajectories
from .report import add_analyze_arguments, analyze, random_model, run_analyze
from .stability import (
    BasinProbe,
    FixedPointSearch,
    LyapunovExponent,
    SampleStability,
    StabilityReport,
    basin_probe,
    classify,
    dense_eigenvalues,
    extreme_eigenvalues,
    find_fixed_point,
    fixed_point_stability,
    flow,
    g_jacobian,
    lanczos,
    lyapunov_exponent,
    normalize_scale,
    operator_stability,
    power_iteration,
    riemannian_hessian_matrix,
    tangent_basis,
)

__all__ = [
    "BasinProbe",
    "ConvergenceReport",
    "ConvergenceTraces",
    "FixedPointSearch",
    "LyapunovExponent",
    "LyapunovReport",
    "RateFit",
    "SampleConvergence",
    "SampleStability",
    "StabilityReport",
    "Violation",
    "add_analyze_arguments",
    "analyze",
    "analyze_convergence",
    "basin_probe",
    "check_lyapunov",
    "classify",
    "convergence_traces",
    "dense_eigenvalues",
    "extreme_eigenvalues",
    "find_fixed_point",
    "fit_decay",
    "fixed_point_stability",
    "flow",
    "g_jacobian",
    "lanczos",
    "lyapunov_exponent",
    "metric_spectrum",
    "normalize_scale",
    "operator_stability",
    "plot_attention",
    "plot_convergence",
    "plot_energy_slice",
    "plot_film_strip",
    "plot_trajectories",
    "power_iteration",
    "random_model",
    "riemannian_hessian_matrix",
    "run_analyze",
    "tangent_basis",
    "tangent_gradient",
]
