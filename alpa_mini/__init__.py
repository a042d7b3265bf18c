"""alpa_mini: two-level auto-parallel planning for JAX.

Today the planning algorithms are public (everything ``alpa_mini.solvers`` exports); the
JAX front end and the runtimes add their names here as they land.
"""

from . import solvers as _solvers
from .solvers import *  # noqa: F403  (the explicit list is solvers.__all__)

__all__ = [*_solvers.__all__]
