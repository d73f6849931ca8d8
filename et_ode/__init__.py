"""et-ode: the Energy Transformer as a continuous-time dynamical system."""

from .adjoints import Adjoint, Direct, Implicit
from .attractor import Attractor, AttractorError, AttractorReadout, find_attractor
from .energies import EnergyAttention, HopfieldMemory
from .field import ETField
from .integration import Integration
from .masks import GraphMask
from .model import EnergyTransformer
from .neurons import LayerNormNeuron
from .solution import Solution, SolveError, SolveStats, Status
from .solve import solve
from .solvers import METHODS, Adaptive, EulerET, Fixed
from .stopping import SteadyState

__all__ = [
    "METHODS",
    "Adaptive",
    "Adjoint",
    "Direct",
    "EulerET",
    "Fixed",
    "Implicit",
    "Integration",
    "SteadyState",
    "Attractor",
    "AttractorError",
    "AttractorReadout",
    "ETField",
    "GraphMask",
    "EnergyAttention",
    "EnergyTransformer",
    "HopfieldMemory",
    "LayerNormNeuron",
    "Solution",
    "SolveError",
    "SolveStats",
    "Status",
    "find_attractor",
    "solve",
]
__version__ = "0.1.0"


def _check_threads() -> None:
    """Warn once when PyTorch's threads would oversubscribe a busy machine (:func:`et_ode.runtime.oversubscription`).
    The ``et-ode`` command checks after applying its ``--threads`` instead."""
    import sys
    from pathlib import Path

    from . import runtime

    entry = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if entry.name == "et-ode" or sys.argv[:1] == ["-m"] or entry.parts[-2:] == ("cli", "__main__.py"):
        return
    runtime.warn_if_oversubscribed()


_check_threads()
