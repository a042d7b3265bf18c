"""alpa_mini: two-level auto-parallel planning for JAX.

Today the planning algorithms (everything ``alpa_mini.solvers`` exports) and the cluster
description are public; the JAX front end and the runtimes add their names as they land.
"""

from . import solvers as _solvers
from .cluster import ClusterSpec, ConfigError, LogicalMesh
from .solvers import *  # noqa: F403  (the explicit list is solvers.__all__)

__all__ = ["ClusterSpec", "ConfigError", "LogicalMesh", *_solvers.__all__]
