"""alpa_mini: two-level auto-parallel planning for JAX.

Decorate a train step with ``@alpa_mini.parallelize(method=...)`` after ``alpa_mini.init()``;
the planning algorithms (everything ``alpa_mini.solvers`` exports) are public too.
"""

from . import solvers as _solvers
from .api import ParallelizedFunction, parallelize
from .auto_sharding import MemoryBudgetError
from .cluster import ClusterSpec, ConfigError, LogicalMesh, available_clusters
from .cost_model import CostModel
from .device_setup import current_cluster, init, is_initialized, shutdown
from .executable import CollectiveReport, Executable
from .micro_batch import grad, value_and_grad
from .op_graph import OpGraph
from .parallel_method import DataParallel, ShardParallel, Zero2Parallel, Zero3Parallel
from .plan import ShardingPlan
from .sharding_spec import ShardingSpec
from .solvers import *  # noqa: F403  (the explicit list is solvers.__all__)

__all__ = [
    "ClusterSpec",
    "CollectiveReport",
    "ConfigError",
    "CostModel",
    "DataParallel",
    "Executable",
    "LogicalMesh",
    "MemoryBudgetError",
    "OpGraph",
    "ParallelizedFunction",
    "ShardParallel",
    "ShardingPlan",
    "ShardingSpec",
    "Zero2Parallel",
    "Zero3Parallel",
    "available_clusters",
    "current_cluster",
    "grad",
    "init",
    "is_initialized",
    "parallelize",
    "shutdown",
    "value_and_grad",
    *_solvers.__all__,
]
