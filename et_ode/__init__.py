"""et-ode: the Energy Transformer as a continuous-time dynamical system."""

from importlib.metadata import version as _version

from et_ode.backend.memory import OutOfMemoryError
from et_ode.dynamics.field import ETField
from et_ode.energy.energies import EnergyAttention, HopfieldMemory, Interaction
from et_ode.energy.masks import GraphMask
from et_ode.energy.model import EnergyModel, EnergyTransformer
from et_ode.energy.neurons import IdentityNeuron, LayerNormNeuron, Neuron
from et_ode.equilibrium.attractor import Attractor, AttractorError, AttractorReadout, find_attractor
from et_ode.integrators.solution import Solution, SolveError, SolveStats, Status
from et_ode.integrators.solvers import METHODS, Adaptive, EulerET, Fixed
from et_ode.integrators.stopping import SteadyState
from et_ode.solving.gradients import Adjoint, Direct, Implicit
from et_ode.solving.integration import Integration
from et_ode.solving.solve import solve

__all__ = [
    "METHODS",
    "Adaptive",
    "Adjoint",
    "Direct",
    "EulerET",
    "Fixed",
    "Implicit",
    "Integration",
    "OutOfMemoryError",
    "SteadyState",
    "Attractor",
    "AttractorError",
    "AttractorReadout",
    "ETField",
    "GraphMask",
    "EnergyAttention",
    "EnergyModel",
    "EnergyTransformer",
    "HopfieldMemory",
    "IdentityNeuron",
    "Interaction",
    "LayerNormNeuron",
    "Neuron",
    "Solution",
    "SolveError",
    "SolveStats",
    "Status",
    "find_attractor",
    "solve",
]
__version__ = _version("et-ode")  # pyproject.toml's, read from the installed metadata


def _check_threads() -> None:
    """Warn once when PyTorch's threads would oversubscribe a busy machine (:func:`et_ode.backend.runtime.oversubscription`).
    The ``et-ode`` command checks after applying its own thread count instead."""
    import sys
    from pathlib import Path

    from et_ode.backend import runtime

    entry = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if entry.name == "et-ode" or sys.argv[:1] == ["-m"] or entry.parts[-2:] == ("cli", "__main__.py"):
        return
    runtime.warn_if_oversubscribed()


_check_threads()
