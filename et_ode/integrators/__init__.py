"""Integrating the field: the solver settings, the steady-state stop, the loops and the solution they return."""
