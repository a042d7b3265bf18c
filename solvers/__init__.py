"""Pure planning algorithms: sharding ILP, stage DP, layer clustering.

This package imports only numpy, pulp and highspy: never jax, ray or the rest of alpa_mini.
"""

from .errors import (
    FractionalRelaxation,
    InfeasibleError,
    SolverInputError,
    SolverTimeLimitError,
)
from .layer_clustering import LayerClustering, LayerCountSearch, cluster_layers, search_num_layers
from .sharding.problem import Evaluation, ShardingProblem, evaluate, load_iopddl, save_iopddl
from .sharding.solve import ShardingSolution, solve_sharding
from .stages import Stage, StageProblem, StageSolution, solve_stages

__all__ = [
    "Evaluation",
    "FractionalRelaxation",
    "InfeasibleError",
    "LayerClustering",
    "LayerCountSearch",
    "ShardingProblem",
    "ShardingSolution",
    "SolverInputError",
    "SolverTimeLimitError",
    "Stage",
    "StageProblem",
    "StageSolution",
    "cluster_layers",
    "evaluate",
    "load_iopddl",
    "save_iopddl",
    "search_num_layers",
    "solve_sharding",
    "solve_stages",
]
