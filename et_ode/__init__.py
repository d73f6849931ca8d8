"""et-ode: the Energy Transformer as a continuous-time dynamical system."""

from .adjoints import Adjoint, Direct, Implicit
from .attractor import Attractor, AttractorError, AttractorReadout, find_attractor
from .energies import EnergyAttention, HopfieldMemory
from .field import ETField
from .gradients import implicit_fixed_point
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
    "implicit_fixed_point",
    "solve",
]
__version__ = "0.1.0"
