"""Analysis tools for ET solutions: convergence, Lyapunov checks, stability, pictures, reports."""
