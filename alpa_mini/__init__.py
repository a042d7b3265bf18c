"""alpa_mini: two-level auto-parallel planning for JAX.

Today the planning algorithms are public; the JAX front end and runtimes build on them.
"""

from .solvers import (
    Evaluation,
    InfeasibleError,
    LayerClustering,
    LayerCountSearch,
    ShardingProblem,
    ShardingSolution,
    SolverInputError,
    SolverTimeLimitError,
    Stage,
    StageProblem,
    StageSolution,
    cluster_layers,
    evaluate,
    load_iopddl,
    save_iopddl,
    search_num_layers,
    solve_sharding,
    solve_stages,
)

__all__ = [
    "Evaluation",
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
